"""``inspect --verify --repair`` puts items back, not only counters (issue 13): items left in a
batch list that no pending batch names, or in a lane of a gone shape instance, go to the
reclaimed list (or are cleared when they have a result); items with a result leave live lanes."""

from __future__ import annotations

from conductor.formats.signature import shape_signature
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract, Result, json_encoder
from conductor.verify import repair, verify
from tests.conftest import cli, item
from tests.helpers import MK, drain, quick, results_for

C = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)
BIG = Contract(model="m", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096)


def half_claimed(cdr, consumer: str = "w"):
    """What claim.lua left before issue 13 when the shipped ACL refused its PUBLISH: the batch's
    items moved lane -> batch list and the lane's counters moved, but no batches entry and none of
    the model's counters (here: a claim whose entry and counters are taken back)."""
    b, _ = cdr.claim(C, consumer)
    cdr.r.xack(MK.batches, K.GROUP, b.batch_id)
    cdr.r.xdel(MK.batches, b.batch_id)
    n, tok = len(b.items), sum(i.input_tokens for i in b.items)
    cdr.r.hincrby(MK.state, "inflight_batches", -1)
    cdr.r.hincrby(MK.state, "inflight_items", -n)
    cdr.r.hincrby(MK.intake, "tokens", tok)
    cdr.r.hincrby(MK.intake, "items", n)
    return b


def all_results_once(cdr, job: str, n: int) -> None:
    ids = [r.id for r in cdr.read_results(job)]
    assert len(ids) == len(set(ids)) == n
    st = cdr.status(job)
    assert st["pending"] == 0 and st["completed"] + st["failed"] == n


def test_an_orphaned_batch_list_goes_back_through_the_cli(cdr, redis_url):
    quick(cdr)
    cdr.submit([item(i, 10 + i) for i in range(10)], "j")
    b = half_claimed(cdr)
    rep = verify(cdr.r, "m", items=True)
    assert not rep.ok and any("orphaned" in p and str(len(b.items)) in p for p in rep.problems), rep.problems
    p = cli("inspect", "m", "--verify", "--repair", url=redis_url, check=False)
    text = p.stdout.decode()
    assert p.returncode == 0, text
    assert f"4 moved to {MK.reclaimed}" in text and "after repair: 0 counter(s) differ" in text
    assert "ledger finding" not in text.split("after repair")[1]
    assert not list(cdr.r.scan_iter(match=f"{MK.base}:bat:*"))
    again, _ = cdr.claim(BIG, "w2")
    assert again.reclaimed and sorted(i.id for i in again.items) == sorted(i.id for i in b.items)
    cdr.complete(again, results_for(again, "w2"))
    drain(cdr, BIG)
    all_results_once(cdr, "j", 10)
    assert verify(cdr.r, "m", items=True).ok


def test_a_leaked_entry_names_the_shape_and_done_items_are_cleared(cdr):
    quick(cdr)
    cdr.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(4)]
               + [item(f"b{i}", 10, prefix=("B",)) for i in range(6)], "j")
    b, _ = cdr.claim(C, "w")
    cdr.complete(b, results_for(b)[:1], final=False)  # one item has its result
    cdr.r.xack(MK.batches, K.GROUP, b.batch_id)  # acked, never deleted: the entry leaked
    cdr.r.hincrby(MK.state, "inflight_batches", -1)
    cdr.r.hincrby(MK.state, "inflight_items", -len(b.items))
    assert not verify(cdr.r, "m", items=True).ok
    changes, failed = repair(cdr.r, "m")
    assert not failed, failed
    assert any(c.new.startswith(f"0 (3 moved to {MK.reclaimed}, 1 with a result cleared)") for c in changes), changes
    assert cdr.r.xlen(MK.batches) == 0  # the leaked entry went with it
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (rep.problems, rep.drift)
    again, _ = cdr.claim(BIG, "w2")
    assert again.reclaimed and again.shape == b.shape and again.prefix == b.prefix and len(again.items) == 3
    cdr.complete(again, results_for(again, "w2"))
    drain(cdr, BIG)
    all_results_once(cdr, "j", 10)


def test_lanes_of_a_gone_instance_and_done_items_in_live_lanes(cdr):
    quick(cdr)
    cdr.submit([item(f"a{i}", 10 + 30 * (i % 2), prefix=("A",)) for i in range(6)]
               + [item(f"b{i}", 10, prefix=("B",)) for i in range(5)], "j")
    a_inst = f"{shape_signature(['A'])}:1"
    # A's instance went (a finish that left its lanes behind); a0 and b0 have results already
    cdr.r.delete(*[MK.inst(a_inst) + sfx for sfx in ("", ":lanes", ":fill", ":ready", ":touch", ":free")])
    cdr.r.zrem(MK.staged, a_inst)
    cdr.r.zrem(MK.staged_age, a_inst)
    for iid in ("a0", "b0"):
        cdr.r.hset(MK.job_items("j"), iid, "d")
        res = Result(id=iid, model="m", job="j", output="o", output_tokens=1, error=None, shape="", epoch=1,
                     lane=0, batch="0-1", batch_size=1, batch_padded_len=16, input_tokens=10, worker="w",
                     claimed_at=0, finished_at=0)
        cdr.r.xadd(MK.job_results("j"), {"id": iid, "r": json_encoder.encode(res)})
        cdr.r.hincrby(MK.job("j"), "completed", 1)
        cdr.r.hincrby(MK.state, "completed", 1)
    rep = verify(cdr.r, "m", items=True)
    assert not rep.ok and rep.done_lanes
    changes, failed = repair(cdr.r, "m")
    assert not failed, failed
    moved = [c.new for c in changes if "moved to" in c.new]
    assert sum(int(v.split("(")[1].split()[0]) for v in moved) == 5  # a1..a5 to the reclaimed list
    assert not list(cdr.r.scan_iter(match=f"{MK.base}:lane*:{a_inst}:*"))
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (rep.problems, [(x.key, x.field, x.recorded, x.truth) for x in rep.drift])
    assert rep.ledger["reclaimed"] == 5 and rep.ledger["waiting"] == 4
    got = drain(cdr, BIG)
    assert sorted(i.id for b in got for i in b.items) == [f"a{i}" for i in range(1, 6)] + [f"b{i}" for i in range(1, 5)]
    assert all(b.shape == shape_signature(["A"]) for b in got if b.items[0].id.startswith("a"))
    all_results_once(cdr, "j", 11)
    assert verify(cdr.r, "m", items=True).ok


def test_an_orphan_of_unknown_shape_is_left_for_a_human(cdr):
    quick(cdr)
    cdr.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(3)]
               + [item(f"b{i}", 10, prefix=("B",)) for i in range(3)], "j")
    half_claimed(cdr)
    changes, failed = repair(cdr.r, "m")
    assert len(failed) == 1 and "which shape its items belong to is unknown" in failed[0]
    rep = verify(cdr.r, "m", items=True)
    assert any("orphaned" in p for p in rep.problems)


def test_a_big_orphaned_lane_goes_back_in_pieces_a_claim_can_take(cdr):
    """claim.lua unpacks what it takes of one reclaimed entry (Lua stops near 8,000 values):
    a lane of 9,000 items goes back as entries of at most 256."""
    quick(cdr)
    cdr.submit([item(f"a{i}", 10) for i in range(9000)], "j")
    inst = f"{shape_signature(['sys'])}:1"
    cdr.r.delete(*[MK.inst(inst) + sfx for sfx in ("", ":lanes", ":fill", ":ready", ":touch", ":free")])
    cdr.r.zrem(MK.staged, inst)
    cdr.r.zrem(MK.staged_age, inst)
    changes, failed = repair(cdr.r, "m")
    assert not failed, failed
    assert cdr.r.llen(MK.reclaimed) == -(-9000 // 256)
    b, _ = cdr.claim(Contract(model="m", max_batch_size=65536, max_batch_tokens=10**9, max_input_len=4096), "w")
    assert b.reclaimed and len(b.items) == 256
    assert verify(cdr.r, "m", items=True).ok
