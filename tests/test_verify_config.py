"""Finding of the accounting work: a lane's fill score and ready membership are derived with the
model's config at the time the lane was last touched. When the reference budget (the first
worker's contract, set by ``Worker.register`` with HSETNX) or the mode changes after items wait,
those indices used to go stale until the lane was touched again (a lane holding a full batch
was not dispatched as one). Fixed: instances carry an index version; Worker.register and
``conductor config`` re-derive at once, claim re-derives lazily. ``verify`` notes an instance
whose indices await re-derivation instead of reporting drift; ``repair`` re-derives them too.
"""

from __future__ import annotations

from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
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


def test_worker_registration_rederives_the_indices_at_once(cdr):
    """The first worker's budget (Worker.register) re-derives lanes that waited for it."""
    from conductor.workers.engines.sim import SimEngine
    from conductor.workers.worker import Worker, WorkerOptions
    quick(cdr, quiet_ms=60_000)
    cdr.submit([item(i, 100) for i in range(20)], "j")
    Worker(cdr, SimEngine("m", max_batch_size=C.max_batch_size, max_batch_tokens=C.max_batch_tokens),
           WorkerOptions(name="w")).register()
    rep = verify(cdr.r, "m")
    assert rep.ok, [(r.key, r.field, r.recorded, r.truth) for r in rep.drift]
    batch, _ = cdr.claim(C, "w")
    assert batch is not None and len(batch.items) == 8


def test_config_change_behind_the_conductors_back_is_rederived_by_claim(cdr):
    mk = _backlog_then_first_worker(cdr)  # raw HSETNX: nothing re-derived yet
    # Indices of an older config are pending re-derivation by design: a note, not drift.
    rep = verify(cdr.r, "m")
    assert rep.ok and len(rep.notes) == 1 and rep.notes[0].startswith(mk.base + ":inst:")
    assert "re-derived when served" in rep.notes[0]
    batch, why = cdr.claim(C, "w")  # the instance's index version differs: claim re-derives first
    assert batch is not None and len(batch.items) == 8  # 20 items of one lane: a full batch of 8
    assert int(cdr.r.hget(mk.state, "reindexes")) == 1
    rep = verify(cdr.r, "m")
    assert rep.ok and rep.notes == []


def test_conductor_config_of_mode_rederives_the_indices(cdr):
    quick(cdr, quiet_ms=60_000, budget_tokens=1024, budget_items=8)
    cdr.submit([item(i, 97) for i in range(10)], "j")  # 10 x 104 padded > 1024, 970 actual < 1024
    assert verify(cdr.r, "m").ok
    cdr.set_config("m", {"mode": "disk", "budget_items": 64})
    assert verify(cdr.r, "m").ok
    cdr.set_config("m", {"mode": "memory"})
    assert verify(cdr.r, "m").ok
    assert repair(cdr.r, "m") == ([], [])
