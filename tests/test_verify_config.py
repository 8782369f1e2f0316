"""Finding of the accounting work: a lane's fill score and ready membership are derived with the
model's config at the time the lane was last touched. When the reference budget (the first
worker's contract, set by ``Worker.register`` with HSETNX) or the mode changes after items wait,
those indices go stale until the lane is touched again: ``verify`` reports them, ``repair``
re-derives them, and until then a lane holding a full batch is not dispatched as one.
"""

from __future__ import annotations

import pytest

from conductor import keys as K
from conductor.records import Contract
from conductor.verify import repair, verify
from tests.conftest import item
from tests.helpers import quick

C = Contract(model="m", max_batch_size=8, max_batch_tokens=1024, max_input_len=4096)


def _backlog_then_first_worker(cdr) -> K.ModelKeys:  # noqa: ANN001
    # A producer submits before any worker registered: lanes are judged with the default budget.
    quick(cdr, quiet_ms=60_000)
    cdr.submit([item(i, 100) for i in range(20)], "j")
    mk = K.ModelKeys("m")
    # What Worker.register does for the first consumer of the model.
    cdr.r.hsetnx(mk.cfg, "budget_tokens", C.max_batch_tokens)
    cdr.r.hsetnx(mk.cfg, "budget_items", C.max_batch_size)
    return mk


@pytest.mark.xfail(strict=True, reason="BUG (lifecycle/worker owners): the first worker's budget (HSETNX in "
                   "Worker.register) or a `conductor config` change of mode/budget_* does not re-derive the "
                   "fill/ready indices of lanes that already wait; fix: re-derive them (lua/repair.lua per "
                   "instance) whenever those fields change")
def test_ready_index_follows_the_reference_budget(cdr):
    _backlog_then_first_worker(cdr)
    rep = verify(cdr.r, "m")
    assert rep.ok, [(r.key, r.field, r.recorded, r.truth) for r in rep.drift]


def test_stale_ready_index_delays_a_full_batch_until_repaired(cdr):
    mk = _backlog_then_first_worker(cdr)
    drift = verify(cdr.r, "m").drift
    assert [r.kind for r in drift] == ["ready.member"] and drift[0].key.startswith(mk.base + ":inst:")
    batch, why = cdr.claim(C, "w")
    assert batch is None and why == "wait"  # 20 items of one lane wait, 8 make a full batch
    changes, failed = repair(cdr.r, "m")
    assert not failed and [c.key for c in changes] == [drift[0].key]
    assert verify(cdr.r, "m").ok
    batch, why = cdr.claim(C, "w")
    assert batch is not None and len(batch.items) == 8
