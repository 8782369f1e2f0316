import json

import msgspec
import pytest

from conductor.errors import BadInput
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
from conductor.verify import verify
from tests.conftest import item
from tests.helpers import quick, results_for

C = Contract(model="m", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096)


def test_completion_is_idempotent_on_item_id(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(5)], "j")
    b, _ = cdr.claim(C, "w")
    assert cdr.complete(b, results_for(b)) == (5, 1)
    assert cdr.complete(b, results_for(b)) == (0, 0)  # second completion writes nothing
    assert len(cdr.read_results("j")) == 5
    st = cdr.status("j")
    assert (st["completed"], st["pending"]) == (5, 0)
    mk = K.ModelKeys("m")
    assert cdr.r.xlen(mk.batches) == 0
    assert cdr.r.xpending(mk.batches, "workers")["pending"] == 0


def test_partial_then_final_completion(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(4)], "j")
    b, _ = cdr.claim(C, "w")
    res = results_for(b)
    assert cdr.complete(b, res[:2], final=False) == (2, 0)
    assert cdr.r.xpending(K.ModelKeys("m").batches, "workers")["pending"] == 1
    assert cdr.complete(b, res, final=True) == (2, 1)
    assert sorted(r.id for r in cdr.read_results("j")) == ["0", "1", "2", "3"]


def test_per_item_errors_are_results(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(3)], "j")
    b, _ = cdr.claim(C, "w")
    cdr.complete(b, results_for(b, error=True))
    st = cdr.status("j")
    assert (st["failed"], st["completed"], st["pending"]) == (3, 0, 0)
    assert all(r.error and r.error.code == "boom" for r in cdr.read_results("j"))


def test_counters_return_to_zero(cdr):
    quick(cdr)
    cdr.submit([item(i, 10 + i) for i in range(100)], "j")
    from tests.helpers import drain
    drain(cdr, C)
    mk = K.ModelKeys("m")
    st = {k.decode(): v.decode() for k, v in {**cdr.r.hgetall(mk.state), **cdr.r.hgetall(mk.intake)}.items()}
    assert st["tokens"] == "0" and st["items"] == "0"
    assert st["inflight_items"] == "0" and st["inflight_batches"] == "0"
    assert st["completed"] == "100"


def test_following_results_never_stops_before_the_last_batch_written(cdr):
    # The last batch completes between the follower's read and its "is the job done?" check:
    # the follower must still hand out that batch's results (it asks before it reads).
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(12)], "j")
    c = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)
    batches = []
    while (b := cdr.claim(c, "w")[0]) is not None:
        batches.append(b)
    assert len(batches) == 3
    for b in batches[:2]:
        cdr.complete(b, results_for(b))
    real_status = cdr.status
    calls = {"n": 0}

    def status_with_a_late_completion(job, models=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the follower has read the first two batches' results by now
            cdr.complete(batches[2], results_for(batches[2]))
        return real_status(job, models)
    cdr.status = status_with_a_late_completion
    got = [json.loads(r)["id"] for r in cdr.results("j", follow=True, block_ms=50)]
    assert sorted(got, key=int) == [str(i) for i in range(12)]


def _dump(r) -> dict:
    return {k: r.dump(k) for k in r.scan_iter(count=1000)}


def test_a_batch_id_the_stream_never_issued_is_refused_with_nothing_written(cdr):
    """Issue 13: 99999999999999999999999-0 passed the pattern check; the results were written,
    then XRANGE refused the id."""
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(4)], "j")
    b, _ = cdr.claim(C, "w")
    before = _dump(cdr.r)
    for bad in ("99999999999999999999999-0", "18446744073709551616-0", "1-18446744073709551616",
                "99999999999999-0", "18446744073709551615-18446744073709551615"):
        with pytest.raises(BadInput, match="batch_id"):
            cdr.complete(msgspec.structs.replace(b, batch_id=bad), results_for(b))
        assert _dump(cdr.r) == before, bad
    assert cdr.complete(b, results_for(b)) == (4, 1)
    assert verify(cdr.r, "m", items=True).ok


def test_results_for_items_outside_the_batch_are_refused_with_nothing_written(cdr):
    """Issue 13: complete.lua took results for items still waiting in a lane (batch 1-0), and
    for items of another batch."""
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(6)], "j")
    two = Contract(model="m", max_batch_size=2, max_batch_tokens=8192, max_input_len=4096)
    b1, _ = cdr.claim(two, "w")
    b2, _ = cdr.claim(two, "w")
    waiting = msgspec.structs.replace(b1, items=[msgspec.structs.replace(b1.items[0], id="5")])  # "5" waits in a lane
    before = _dump(cdr.r)
    # a batch id below the stream's last id that names no entry: nothing of it is taken
    assert cdr.complete(msgspec.structs.replace(waiting, batch_id="1-0"), results_for(waiting)) == (0, 0)
    assert _dump(cdr.r) == before
    with pytest.raises(BadInput, match="item 5 of job j is not in batch"):
        cdr.complete(b1, results_for(b1) + results_for(waiting))
    mixed = results_for(b1)[:1] + results_for(b2)[:1]
    with pytest.raises(BadInput, match=f"item {b2.items[0].id} of job j is not in batch {b1.batch_id}"):
        cdr.complete(b1, mixed)
    other_job = [msgspec.structs.replace(r, job="k") for r in results_for(b1)]
    with pytest.raises(BadInput, match="of job k is not in batch"):
        cdr.complete(b1, other_job)
    assert _dump(cdr.r) == before
    assert cdr.complete(b1, results_for(b1)) == (2, 1)
    assert cdr.complete(b2, results_for(b2)) == (2, 1)
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, rep.problems
    assert cdr.status("j")["completed"] == 4
