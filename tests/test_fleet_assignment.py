"""Issue 24: which shape instance each worker of a fleet takes (lua/lib_lifecycle.lua pick_next), on
small hand-made cases through the real claim.lua: remaining work, the split of a deep shape, joining
and helping, longest decodes first, and the cases where a greedy choice goes wrong."""

from __future__ import annotations

import time

from conductor.formats.signature import shape_signature
from tests.conftest import item
from tests.helpers import MK, contract, quick

C = contract(size=8, tokens=1000)


def _live(cdr, *workers: str) -> None:
    """Registered workers with a heartbeat: the fleet a fair share is counted over."""
    for w in workers:
        cdr.r.set(MK.heartbeat(w), 1)
        cdr.r.hset(MK.workers, w, "{}")


def _submit(cdr, shape: str, n: int, tokens: int = 96, max_tokens: int = 16) -> str:
    cdr.submit([item(f"{shape}{i}", tokens, prefix=(shape,), max_tokens=max_tokens) for i in range(n)], "j")
    return shape_signature([shape])


def _shape_of(cdr, worker: str) -> str:
    """The shape of the batch ``worker`` claims now."""
    return cdr.claim(C, worker)[0].shape


def _setup(cdr, **cfg) -> None:
    quick(cdr, budget_tokens=1000, budget_items=8, activate_batches=1, quiet_ms=60_000, **cfg)


def test_a_deep_shape_is_split_over_the_workers_its_work_deserves_and_shallow_ones_get_one_each(cdr):
    """One deep shape (70 of 160 items: 1.75 fair shares of 4 workers) and three shallow ones: the
    deep one is served by two workers (as many as its work over a fair share, rounded up, as the
    oracle splits it), each shallow one by one worker of its own; greedy by size alone would put
    every idle worker on the deep shape."""
    _setup(cdr)
    _live(cdr, "w1", "w2", "w3", "w4")
    deep = _submit(cdr, "D", 70)
    shallow = {_submit(cdr, s, 30) for s in ("A", "B", "C")}
    got = {w: _shape_of(cdr, w) for w in ("w1", "w2", "w3", "w4")}
    assert list(got.values()).count(deep) == 2
    assert {s for s in got.values() if s != deep} <= shallow and len(set(got.values())) == 3
    # each stays on its instance while it has items (warm affinity)
    for w, s in got.items():
        assert all(_shape_of(cdr, w) == s for _ in range(2))


def test_longest_decodes_start_first_so_the_job_ends_on_short_ones(cdr):
    """Two shapes of equal size: the one with the longer output limit is started first."""
    _setup(cdr)
    _live(cdr, "w1")
    short = _submit(cdr, "S", 40, max_tokens=16)
    long_ = _submit(cdr, "L", 40, max_tokens=512)
    assert _shape_of(cdr, "w1") == long_
    assert short != long_


def test_more_work_goes_first_among_equal_decodes(cdr):
    """Equal output limits: the shape with more remaining work (tokens, and output limits x decode_weight) first."""
    _setup(cdr)
    _live(cdr, "w1")
    _submit(cdr, "small", 16)
    big = _submit(cdr, "big", 48)
    assert _shape_of(cdr, "w1") == big


def test_a_worker_joining_late_takes_over_part_of_the_deep_shape(cdr):
    """One worker on the only shape; a second joins (autoscaling): it joins that shape, since the
    first holds more than a fair share, rather than wait."""
    _setup(cdr)
    _live(cdr, "w1")
    deep = _submit(cdr, "D", 80)
    assert _shape_of(cdr, "w1") == deep
    _live(cdr, "w2")
    assert _shape_of(cdr, "w2") == deep


def test_no_worker_joins_a_shape_that_is_about_to_be_finished(cdr):
    """The last shape holds one batch beyond its worker's: a newcomer does not join it (it would
    take the batch its worker is about to take), it waits."""
    _setup(cdr)
    _live(cdr, "w1")
    only = _submit(cdr, "D", 16)  # two batches of 8
    assert _shape_of(cdr, "w1") == only
    _live(cdr, "w2")
    b, why = cdr.claim(C, "w2")
    assert b is None and why == "wait"
    assert _shape_of(cdr, "w1") == only


def test_a_shape_its_worker_stopped_serving_is_helped_after_hygiene_idle_ms(cdr):
    """A live worker that takes nothing from its shape (gated, or stuck) for hygiene_idle_ms: another
    worker helps rather than idle."""
    _setup(cdr, hygiene_idle_ms=200)
    _live(cdr, "w1")
    only = _submit(cdr, "D", 16)
    assert _shape_of(cdr, "w1") == only
    _live(cdr, "w2")
    assert cdr.claim(C, "w2")[0] is None
    time.sleep(0.3)
    assert _shape_of(cdr, "w2") == only


def test_an_instance_left_by_its_workers_is_taken_first(cdr):
    """A worker leaves (deregistered, heartbeat gone) its half-served shape: the next worker to pick
    takes it before any staged one, so it does not wait for ever."""
    _setup(cdr)
    _live(cdr, "w1", "w2")
    left = _submit(cdr, "D", 40, max_tokens=8)
    assert _shape_of(cdr, "w1") == left
    _submit(cdr, "E", 40, max_tokens=512)  # staged, and first by its output limit
    cdr.r.delete(MK.heartbeat("w1"))
    cdr.r.hdel(MK.workers, "w1")
    assert _shape_of(cdr, "w2") == left

