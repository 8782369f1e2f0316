"""Issue 25: answered ids leave the id registry and done marks for a packed form of 16 bytes an id
(lua/compact_ids.lua, lua/lib_packed.lua), and every check that read the two reads it too: a
re-submitted id is a duplicate (or a conflict), a re-delivered answered item is not answered twice,
and conductor/verify/ counts the packed ids."""

from __future__ import annotations

import json

import pytest

from conductor.errors import BadInput, Conflict
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.packed_ids import packed_count, packed_sums
from conductor.redis_contract.records import Contract
from conductor.tier.compact_ids import bucket_digits, compact_model
from conductor.verify import verify
from tests.conftest import item
from tests.helpers import drain, quick, results_for

C = Contract(model="m", max_batch_size=64, max_batch_tokens=65536, max_input_len=4096)
MK = K.ModelKeys("m")


def _items(n: int, tag: str = "x", shapes: int = 3) -> list:
    return [item(f"{tag}-{i:06d}", 10 + i % 50, prefix=(f"s{i % shapes}",)) for i in range(n)]


def _bytes(r, *keys: str) -> int:
    return sum(int(r.memory_usage(k) or 0) for k in keys)


def test_answered_ids_pack_to_a_tenth_of_their_bytes_and_stay_known(cdr):
    quick(cdr)
    n = 5000
    cdr.submit(_items(n), "j")
    drain(cdr, C)
    before = _bytes(cdr.r, MK.job_sums("j"), MK.job_items("j"))
    assert compact_model(cdr, "m", min_done=1) == n
    after = _bytes(cdr.r, MK.job_sums("j"), MK.job_items("j"), MK.job_packed("j"))
    assert cdr.r.hlen(MK.job_sums("j")) == 0 and cdr.r.hlen(MK.job_items("j")) == 0
    assert packed_count(cdr.r, MK, "j") == n
    print(f"registry and done marks: {before / n:.1f} bytes an id before, {after / n:.1f} after")
    assert after * 5 < before, (before / n, after / n)
    # the same items again: every one a duplicate, nothing placed, no second result
    res = cdr.submit(_items(n), "j")
    assert res.accepted == 0 and res.duplicates == n
    assert cdr.claim(C, "w")[0] is None
    # one of them with other content: a conflict, nothing written
    other = item("x-000007", 999, prefix=("s1",))
    with pytest.raises(Conflict):
        cdr.submit([other], "j")
    assert cdr.r.xlen(MK.job_results("j")) == n
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, ([(d.key, d.field, d.recorded, d.truth) for d in rep.drift], rep.problems)
    # a new id still goes in
    assert cdr.submit([item("y-1", 12)], "j").accepted == 1


def test_a_packed_item_delivered_again_is_not_answered_twice(cdr):
    quick(cdr, max_deliveries=5)
    cdr.submit(_items(3, shapes=1), "j")
    b, _ = cdr.claim(C, "a")
    assert b is not None and len(b.items) == 3
    first = results_for(b, "a")[:1]
    cdr.complete(b, first, final=False)  # one written; the batch stays in flight
    assert compact_model(cdr, "m", min_done=1) == 1
    assert cdr.r.hlen(MK.job_items("j")) == 0
    # complete.lua: the packed item's result is not written again
    assert cdr.complete(b, results_for(b, "a"), final=False)[0] == 2
    b2, _ = cdr.claim(C, "a")
    assert b2 is None
    cdr.fail(b, "a", "engine broke")  # the requeue drops the answered items (packed or marked)
    assert cdr.claim(C, "b")[0] is None
    ids = [json.loads(f[b"r"])["id"] for _e, f in cdr.r.xrange(MK.job_results("j"))]
    assert sorted(ids) == sorted(it.id for it in b.items)  # each once
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, ([(d.key, d.field, d.recorded, d.truth) for d in rep.drift], rep.problems)


def test_compact_ids_packs_only_answered_ids_with_a_plain_sum(cdr):
    quick(cdr)
    cdr.submit(_items(4), "j")
    ids = [f"x-{i:06d}" for i in range(4)]
    # nothing answered yet: nothing packed
    assert calls.compact_ids(MK, "j", 1, ids).run(cdr.scripts) == 0
    drain(cdr, C)
    assert calls.compact_ids(MK, "j", 1, [*ids, ids[0], "unknown"]).run(cdr.scripts) == 4
    assert calls.compact_ids(MK, "j", 1, ids).run(cdr.scripts) == 0  # moved already
    sums = packed_sums(cdr.r, MK, "j", [*ids, "unknown"])
    assert all(s is not None and len(s) == 16 for s in sums[:4]) and sums[4] is None
    with pytest.raises(BadInput, match="k: bucket digits"):
        calls.compact_ids(MK, "j", 9, ids).run(cdr.scripts)
    assert [bucket_digits(n) for n in (10, 30_000, 100_000, 1_000_000, 10_000_000)] == [1, 2, 3, 4, 4]


def test_the_job_ledger_of_a_packed_job_names_every_answer_once(cdr):
    """conductor verify-job from the id registry (no kept input): ids packed out of it are still
    the job's lines, each answered once."""
    from conductor.jobs.job_ledger import build
    quick(cdr)
    cdr.submit(_items(500), "j")
    drain(cdr, C)
    assert compact_model(cdr, "m", min_done=1) == 500
    led = build(cdr, "j", None)
    assert led.clean, (led.doubled[:3], led.missing[:3], led.phantom[:3], led.lost)
    assert led.inputs == 500 and led.kinds["completed"] == 500
