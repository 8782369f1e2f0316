"""Scenarios that bring every script of lua/ to each of its branches, for the atomicity harness
(tests/test_script_acl_atomicity.py): each builds a state through the real API (and a few raw
writes where no API reaches) and returns the script call to make in it.

Also: which commands a script may call (parsed from its source and the lib.lua helpers it uses),
a fingerprint of the whole database (DEBUG DIGEST, which leaves out consumer groups, plus XINFO
STREAM FULL of every stream), and a snapshot that restores the database to the byte.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from conductor.client import Conductor
from conductor.jobs.deadletter import DeadLetter
from conductor.redis_contract import keys as K
from conductor.redis_contract import scripts
from conductor.redis_contract.scripts import source
from tests.conftest import ROOT, item
from tests.helpers import MK, contract, quick, results_for

LUA = ROOT / "lua"


@dataclass
class Call:
    script: str
    keys: list[str]
    args: list[Any]
    # what the call must have done when run as the default user (the branch it is there for)
    check: Callable[[redis.Redis], Any] | None = None


def claim_call(consumer: str = "w", size: int = 64, tokens: int = 8192, token: str = "t0k3n") -> Call:
    return Call("claim", [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed], [consumer, size, tokens, token])


def complete_call(batch: Any, results: list, final: int = 1) -> Call:
    from conductor.redis_contract.records import json_encoder
    args: list[Any] = [batch.batch_id, final, len(results)]
    for res in results:
        args += [res.job, res.id, "err" if res.error else "ok", json_encoder.encode(res)]
    return Call("complete", [MK.base, MK.state, MK.batches], args)


def reclaim_call(consumer: str, force: int = 0, min_idle: int = 0, count: int = 100) -> Call:
    return Call("reclaim", [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed], [consumer, force, min_idle, count])


def fail_call(batch: Any, consumer: str, reason: str = "engine error") -> Call:
    return Call("fail", [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed], [batch.batch_id, consumer, reason])


def submit_call(c: Conductor, items: list, job: str = "j") -> Call:
    from conductor.redis_contract.script_calls import submit_args as _submit_args
    c.ensure_model("m")
    return Call("submit", [MK.base, MK.cfg, MK.state], _submit_args(job, items))


def inst_of(c: Conductor, sig: str | None = None) -> str:
    """The one (or the given signature's) shape instance of model m."""
    keys = c.r.scan_iter(match=f"{MK.base}:inst:*:lanes")
    names = sorted({k.decode().split(":inst:")[1].split(":lanes")[0] for k in keys})
    return next(n for n in names if sig is None or n.startswith(sig))


# ------------------------------------------------------------------ claim

def claim_warming(c: Conductor) -> Call:
    """The first claim opens the gate, activates the fuller shape, takes a batch from it and, with
    the active shape then low, marks the other shape warming (issue 13: the PUBLISH that the
    shipped ACL refused came after these writes)."""
    quick(c, budget_tokens=64, budget_items=4, activate_batches=1, prewarm_batches=2, quiet_ms=60000)
    c.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(12)], "j")
    c.submit([item(f"b{i}", 10, prefix=("B",)) for i in range(10)], "j")
    call = claim_call(size=4, tokens=64)
    call.check = lambda r: r.hget(MK.state, "warming") and r.hget(MK.state, "warmings") == b"1"
    return call


def claim_warmed_shape_activates(c: Conductor) -> Call:
    """The active shape is empty: it drains and finishes, and the warming one activates."""
    call = claim_warming(c)
    assert c.claim(contract(4, 64, max_input_len=4096), "w0")[0] is not None
    assert c.claim(contract(64, 8192, max_input_len=4096), "w0")[0] is not None  # the rest of the active shape
    assert c.r.hget(MK.state, "warming")
    call.args[0] = "w0"  # each worker warms its own next shape: w0's is the one it switches to
    call.check = lambda r: not r.hget(MK.state, "warming") and r.hget(MK.state, "shapes_finished") == b"1"
    return call


def claim_reclaimed_part(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(6)], "j")
    c.claim(contract(6, max_input_len=4096), "dead")
    assert c.reclaim_dead("m")["items"] == 6
    return claim_call(size=4)


def claim_reclaimed_whole(c: Conductor) -> Call:
    call = claim_reclaimed_part(c)
    call.args[1] = 64
    return call


def claim_finish_and_next(c: Conductor) -> Call:
    quick(c, budget_tokens=64, budget_items=4, quiet_ms=60000)
    c.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(2)], "j")
    assert len(c.claim(contract(8, max_input_len=4096), "w0")[0].items) == 2
    c.submit([item(f"b{i}", 10, prefix=("B",)) for i in range(6)], "j")
    return claim_call()


def claim_joins_a_deep_shape(c: Conductor) -> Call:
    """A second live worker joins the deep shape the first one serves (the fleet counted from the
    live registered workers: issue 24)."""
    quick(c, budget_tokens=64, budget_items=4, activate_batches=1, quiet_ms=60000)
    for w in ("w0", "w"):
        c.r.set(MK.heartbeat(w), 1)
        c.r.hset(MK.workers, w, "{}")
    c.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(40)], "j")
    assert c.claim(contract(4, 64, max_input_len=4096), "w0")[0] is not None
    call = claim_call(size=4, tokens=64)
    call.check = lambda r: r.hget(MK.affinity, "w") == r.hget(MK.affinity, "w0")
    return call


def _classed(c: Conductor, job: str, tenant: str = "", priority: str = "batch") -> None:
    from conductor.redis_contract.records import JobClass
    c.set_job_class(job, ["m"], JobClass(tenant, priority))


def claim_interactive_first(c: Conductor) -> Call:
    """Interactive work is served first, whatever the worker's own shape (issue 26)."""
    quick(c, budget_tokens=64, budget_items=4, activate_batches=1, quiet_ms=60000)
    c.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(12)], "j")
    assert c.claim(contract(4, 64, max_input_len=4096), "w")[0] is not None
    _classed(c, "rq.x", priority="interactive")
    c.submit([item("q", 10, prefix=("A",))], "rq.x")
    call = claim_call(size=4, tokens=64)
    call.check = lambda r: not r.exists(MK.hot) and r.hget(MK.state, "batches") == b"2"
    return call


def _two_tenants(c: Conductor, both: bool) -> None:
    """Tenants A and B on a fleet of two; w serves one, w0 the other when `both` (else the other's
    shape stays staged); w's tenant leads in service by far, and the next claim sweeps."""
    quick(c, budget_tokens=64, budget_items=4, activate_batches=1, quiet_ms=60000)
    for w in ("w0", "w"):
        c.r.set(MK.heartbeat(w), 1)
        c.r.hset(MK.workers, w, "{}")
    _classed(c, "ja", tenant="A")
    _classed(c, "jb", tenant="B")
    c.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(40)], "ja")
    c.submit([item(f"b{i}", 10, prefix=("B",)) for i in range(40)], "jb")
    assert c.claim(contract(4, 64, max_input_len=4096), "w")[0] is not None
    if both:
        assert c.claim(contract(4, 64, max_input_len=4096), "w0")[0] is not None
    mine = c.r.hget(MK.affinity, "w").decode()
    tenant = c.r.hget(MK.inst(mine), "tenant").decode()
    c.r.hset(MK.vtc, tenant, 10**9)  # far ahead in service
    c.r.hset(MK.state, "sweep_ms", 0)


def claim_fair_loan(c: Conductor) -> Call:
    """The worker whose tenant leads in service by far takes one batch of the shape the other
    tenant's worker serves, keeping its own (lua/lib_serve.lua lend)."""
    _two_tenants(c, True)
    call = claim_call(size=4, tokens=64)
    call.check = lambda r: r.hget(MK.state, "fair_loans") == b"1"
    return call


def claim_fair_switch(c: Conductor) -> Call:
    """The same with no worker on the other tenant's shape: nothing to lend from, so the worker is
    moved to that tenant (lua/lib_serve.lua rebalance)."""
    _two_tenants(c, False)
    call = claim_call(size=4, tokens=64)
    call.check = lambda r: r.hget(MK.state, "fair_switches") == b"1"
    return call


def claim_aging_preempts(c: Conductor) -> Call:
    quick(c, budget_tokens=64, budget_items=4, quiet_ms=60000, aging_ms=0)
    c.submit([item(f"a{i}", 10 + i % 3 * 30, prefix=("A",)) for i in range(40)], "j")
    assert c.claim(contract(4, 64, max_input_len=4096), "w0")[0] is not None
    c.submit([item(f"b{i}", 10, prefix=("B",)) for i in range(2)], "j")
    c.r.hset(MK.cfg, "aging_ms", 1)
    c.r.hset(MK.state, "sweep_ms", 0)
    time.sleep(0.01)
    return claim_call(size=4, tokens=64)


def claim_hygiene_drains(c: Conductor) -> Call:
    """A small lane nobody assigned to for a while is force-drained; an empty one retired; a big
    one looked at later (the touch set holds all three)."""
    quick(c, budget_tokens=10_000, budget_items=1000, quiet_ms=60000, lane_quiet_ms=600000,
          hygiene_idle_ms=100000, lane_floor=0, lane_cap=8)
    c.submit([item(f"s{i}", 10, prefix=("A",)) for i in range(2)]
             + [item(f"m{i}", 200, prefix=("A",)) for i in range(3)]
             + [item(f"b{i}", 900, prefix=("A",)) for i in range(20)], "j")
    # drain the 200-token lane (it stays listed, empty, since lane_quiet_ms is long)
    inst = inst_of(c)
    c.r.zadd(MK.active, {inst: int(time.time() * 1000)})
    c.r.hset(MK.inst(inst), "state", "draining")
    c.r.zrem(MK.staged, inst)
    c.r.zrem(MK.staged_age, inst)
    lanes = {int(rep): lane.decode() for lane, rep in c.r.zrange(MK.inst_lanes(inst), 0, -1, withscores=True)}
    c.r.zadd(MK.inst_ready(inst), {lanes[200]: int(lanes[200])})
    c.r.hset(MK.state, "gate", 1)
    b, _ = c.claim(contract(64, 600, max_input_len=4096), "w0")  # the whole 200-token lane, no neighbour fits beside it
    assert b is not None and b.padded_len == 200 and len(b.items) == 3, b
    c.r.hset(MK.cfg, "hygiene_idle_ms", 1)
    c.r.hset(MK.state, "sweep_ms", 0)
    time.sleep(0.01)
    for lane in lanes.values():
        c.r.zadd(MK.inst(inst) + ":touch", {lane: 1})
    return claim_call(tokens=100_000)


def claim_hygiene_retires_empty(c: Conductor) -> Call:
    call = claim_hygiene_drains(c)
    inst = inst_of(c)
    small = [lane for lane, rep in c.r.zrange(MK.inst_lanes(inst), 0, -1, withscores=True) if int(rep) == 10][0]
    c.r.zadd(MK.inst(inst) + ":touch", {small: 10**15})  # only the empty lane and the big one are stale
    return call


def claim_hygiene_big_lane(c: Conductor) -> Call:
    call = claim_hygiene_drains(c)
    inst = inst_of(c)
    for lane, rep in c.r.zrange(MK.inst_lanes(inst), 0, -1, withscores=True):
        if int(rep) != 900:
            c.r.zadd(MK.inst(inst) + ":touch", {lane: 10**15})
    return call


def claim_reindexes(c: Conductor) -> Call:
    quick(c, budget_tokens=64, budget_items=4)
    c.submit([item(i, 10) for i in range(10)], "j")
    c.r.hset(MK.cfg, "budget_tokens", 32)  # not through set_config: the claim re-derives lazily
    return claim_call(size=4, tokens=64)


def claim_enters_cleanup(c: Conductor) -> Call:
    quick(c, activate_batches=100, quiet_ms=1)
    c.submit([item(i, 10) for i in range(3)], "j")
    time.sleep(0.01)
    return claim_call(size=1)


def claim_leaves_cleanup(c: Conductor) -> Call:
    """Nothing waits in cleanup mode: the claim leaves it and counts its time."""
    quick(c)
    c.r.hset(MK.state, mapping={"cleanup": 1, "cleanup_since_ms": 1})
    return claim_call()


# ------------------------------------------------------------------ job class

def job_class_new(c: Conductor) -> Call:
    quick(c)
    call = Call("job_class", [MK.job_intake("j"), MK.state], ["T", "interactive", 0])
    call.check = lambda r: r.hget(MK.job_intake("j"), "prio") == b"interactive"
    return call


# ------------------------------------------------------------------ submit

def submit_new_shapes(c: Conductor) -> Call:
    quick(c, max_waiting_tokens=10**9)
    c.submit([item("old", 10, prefix=("A",))], "j")
    return submit_call(c, [item(f"n{i}", 10 + 100 * i, prefix=(("A",), ("B",))[i % 2]) for i in range(6)]
                       + [item("old", 10, prefix=("A",))])


def submit_leaves_cleanup_reuses_lane(c: Conductor) -> Call:
    quick(c, lane_cap=8)
    c.submit([item("a", 10)], "j")
    inst = inst_of(c)
    c.r.sadd(MK.inst_free(inst), 7)
    c.r.hset(MK.state, mapping={"cleanup": 1, "cleanup_since_ms": 1})
    return submit_call(c, [item("b", 3000)])


def submit_known_shape_without_prefix(c: Conductor) -> Call:
    """A signature whose prefix is stored already may come without it."""
    quick(c)
    c.submit([item("a", 10)], "j")
    call = submit_call(c, [item("b", 10), item("c", 20)])
    call.args[4] = b""
    return call


def _stored(c: Conductor, n: int, job: str = "j") -> Any:
    """n items of model m in a segment (its file not written) registered as register_segment.lua's
    call would: the segment, and that call (not run)."""
    from conductor.redis_contract import script_calls as calls
    from conductor.redis_contract.item_record import content_sum
    from conductor.redis_contract.item_record import record_head as _record_head
    from conductor.tier import segments as S
    items = [item(f"s{i}", 10 + i) for i in range(n)]
    seg = S.build("m", job, items)
    call = calls.register_segment(MK, seg, S.file_sum(S.encode(seg)), [it.id for it in items],
                                  [content_sum(_record_head(job), it) for it in items])
    return seg, call


def register_segment_new(c: Conductor) -> Call:
    quick(c)
    c.submit([item("a", 10)], "j")
    _seg, reg = _stored(c, 5)
    return Call("register_segment", reg.keys, reg.args, check=lambda r: r.zcard(MK.segs) == 1)


def submit_from_store(c: Conductor) -> Call:
    """The feeder's load: ids registered in a segment join lanes, stored counters move to waiting."""
    from conductor.redis_contract.script_calls import load_args
    quick(c)
    seg, reg = _stored(c, 5)
    reg.run(c.scripts)
    return Call("submit", [MK.base, MK.cfg, MK.state], load_args(seg),
                check=lambda r: r.hget(MK.intake, "stored_items") == b"0" and r.hget(MK.intake, "items") == b"5")


def fail_stored(c: Conductor) -> Call:
    """A lost segment's items answered with error results."""
    from conductor.redis_contract.records import Result, ResultError, json_encoder
    quick(c)
    seg, reg = _stored(c, 3)
    reg.run(c.scripts)
    out: list[Any] = [seg.name]
    for i in range(3):
        res = Result(id=f"s{i}", model="m", job="j", output="", output_tokens=0, error=ResultError("x", "y"),
                     shape=seg.sig, epoch=0, lane=-1, batch="", batch_size=0, batch_padded_len=0, input_tokens=0,
                     worker="repair", claimed_at=0, finished_at=0)
        out += [f"s{i}", json_encoder.encode(res)]
    return Call("fail_stored", [MK.intake, MK.state, MK.segs, MK.seg(seg.name), MK.job_sums("j"), MK.job("j"),
                                MK.job_items("j"), MK.job_results("j"), MK.job_stored("j"), MK.seg_ids(seg.name),
                                MK.base], out,
                check=lambda r: r.xlen(MK.job_results("j")) == 3)


def offload_results(c: Conductor) -> Call:
    """The oldest results of a job leave its stream as their segment is registered."""
    quick(c)
    c.submit([item(f"o{i}", 10) for i in range(4)], "j")
    b, _ = c.claim(contract(), "w")
    c.complete(b, results_for(b))
    eids = [e.decode() for e, _f in c.r.xrange(MK.job_results("j"), count=3)]
    record = json.dumps({"path": "results/x.parquet", "first": eids[0], "last": eids[-1], "n": 3, "sum": "0"})
    return Call("offload_results", [MK.job_results("j"), MK.job_rsegs("j"), MK.state], [record, *eids],
                check=lambda r: r.xlen(MK.job_results("j")) == 1 and r.llen(MK.job_rsegs("j")) == 1)


def compact_ids(c: Conductor) -> Call:
    """Answered ids leave the registry and done marks for their packed form (lua/compact_ids.lua)."""
    quick(c)
    c.submit([item(f"k{i}", 10) for i in range(4)], "j")
    b, _ = c.claim(contract(), "w")
    c.complete(b, results_for(b))
    return Call("compact_ids", [MK.job_items("j"), MK.job_sums("j"), MK.job_packed("j"), MK.state],
                [1, 4, *[f"k{i}" for i in range(4)]],
                check=lambda r: r.hlen(MK.job_items("j")) == 0 and r.hget(MK.job_packed("j"), "n") == b"4")


# ------------------------------------------------------------------ complete

def complete_final(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    res = results_for(b)
    res[1] = results_for(b, error=True)[1]
    c.complete(b, res[:1], final=False)
    return complete_call(b, res)


def complete_retired(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    c.complete(b, results_for(b))
    return complete_call(b, results_for(b))


def complete_request(c: Conductor) -> Call:
    """A request job's results also go to each item's reply list (conductor/client/request.py)."""
    quick(c)
    c.submit([item(i, 10) for i in range(3)], "rq.client1")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    call = complete_call(b, results_for(b))
    call.check = lambda r: r.llen(MK.reply("rq.client1", "0")) == 1 and 0 < r.pttl(MK.reply("rq.client1", "2"))
    return call


# ------------------------------------------------------------------ reclaim, fail, dead letter

def reclaim_dead_consumer(c: Conductor) -> Call:
    quick(c, max_deliveries=1)
    c.submit([item(i, 10) for i in range(6)], "j")
    b1, _ = c.claim(contract(2, max_input_len=4096), "dead")
    c.claim(contract(2, max_input_len=4096), "dead")
    c.complete(b1, results_for(b1)[:1], final=False)  # an item with a result is dropped
    c.r.hset(MK.workers, "dead", "{}")
    return reclaim_call("dead")


def fail_requeues(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    return fail_call(b, "w")


def fail_dead_letters(c: Conductor) -> Call:
    quick(c, max_deliveries=1)
    c.submit([item(i, 10) for i in range(4)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    return fail_call(b, "w")


def hand_over(c: Conductor) -> Call:
    # a claimed batch of an old shard taken out of it into its moving list (conductor/client/shard_migrate.py)
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    token = c.r.xrange(MK.batches, b.batch_id, b.batch_id)[0][1][b"k"].decode()
    return Call("hand_over", [MK.base, MK.state, MK.batches], [b.batch_id, "w", token],
                check=lambda r: r.llen(MK.moving_items(token)) == 4 and r.hget(MK.job_intake("j"), "submitted") == b"0")


def hand_in(c: Conductor) -> Call:
    # items delivered twice on an old shard, taken in by their new one with that count (a moved
    # batch is one shape; one id the job has already here is skipped)
    from conductor.redis_contract.script_calls import submit_args as _submit_args
    quick(c)
    its = [item(i, 10, prefix=("A",)) for i in range(4)]
    c.submit(its[:1], "j")
    args = [*_submit_args("j", its), 3]
    args[4] = b""  # the shape's prefix is stored here already (read back, not sent)
    return Call("hand_in", [MK.base, MK.cfg, MK.state, MK.reclaimed], args,
                check=lambda r: r.llen(MK.reclaimed) == 3 and r.hget(MK.state, "reclaimed_items") == b"3"
                and r.hget(MK.job_intake("j"), "submitted") == b"4")


def dead_retry(c: Conductor) -> Call:
    quick(c, max_deliveries=1)
    c.submit([item(i, 10) for i in range(3)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    c.fail(b, "w", "boom")
    ids = [d.entry for d in DeadLetter(c).items(model="m")]
    assert len(ids) == 3
    return Call("dead_retry", [MK.base, MK.state, MK.dead, MK.reclaimed], [*ids, ids[0], "1-0"])


def dead_retry_packed(c: Conductor) -> Call:
    """A dead-lettered item whose id was packed goes back to the registry as it is retried."""
    quick(c, max_deliveries=1)
    c.submit([item(i, 10) for i in range(2)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    c.fail(b, "w", "boom")
    c.scripts.compact_ids(keys=[MK.job_items("j"), MK.job_sums("j"), MK.job_packed("j"), MK.state],
                          args=[1, 2, "0", "1"])
    ids = [d.entry for d in DeadLetter(c).items(model="m")]
    return Call("dead_retry", [MK.base, MK.state, MK.dead, MK.reclaimed], ids,
                check=lambda r: r.hlen(MK.job_sums("j")) == 2 and r.hget(MK.job_packed("j"), "n") == b"0")


# ------------------------------------------------------------------ reindex, repair, trim

def reindex(c: Conductor) -> Call:
    quick(c, budget_tokens=64, budget_items=4)
    c.submit([item(i, 10 + i) for i in range(10)], "j")
    inst = inst_of(c)
    c.r.hset(MK.cfg, "budget_tokens", 32)
    return Call("reindex", [MK.base, MK.cfg, MK.state], [inst])


def repair(c: Conductor) -> Call:
    quick(c, budget_tokens=64, budget_items=4)
    c.submit([item(i, 10 + i * 20) for i in range(8)], "j")
    inst = inst_of(c)
    lanes = [x.decode() for x in c.r.zrange(MK.inst_lanes(inst), 0, -1)]
    c.r.hset(MK.lanemeta(inst, lanes[0]), mapping={"items": 99, "tokens": 1, "rep": 1})
    c.r.hdel(MK.lanemeta(inst, lanes[1]), "last_ms", "since_ms")
    c.r.zrem(MK.inst_fill(inst), lanes[1])
    c.r.zadd(MK.inst_ready(inst), {lanes[2]: 1})
    c.r.zadd(MK.inst_fill(inst), {"77": 5})
    c.r.zadd(MK.inst_ready(inst), {"77": 77})
    c.r.zadd(MK.inst_lanes(inst), {"78": 5})
    c.r.sadd(MK.inst_free(inst), lanes[3])
    c.r.hset(MK.inst(inst), mapping={"tokens": 1, "items": 1, "idx": "old"})
    c.r.zadd(MK.staged, {inst: 3, "feedfeedfeedfeed:1": 4})
    return Call("repair", [MK.base, MK.cfg, MK.state], [inst, "79"])


def repair_unstaged(c: Conductor) -> Call:
    call = repair(c)
    c.r.hset(MK.inst(call.args[0]), "state", "active")
    return call


def repair_gone_instance(c: Conductor) -> Call:
    quick(c)
    c.r.zadd(MK.staged, {"feedfeedfeedfeed:1": 4})
    return Call("repair", [MK.base, MK.cfg, MK.state], ["feedfeedfeedfeed:1"])


def trim_pending(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    b, _ = c.claim(contract(1, max_input_len=4096), "w")
    c.claim(contract(1, max_input_len=4096), "w")
    c.complete(b, results_for(b))
    c.r.xadd(MK.finished, {"inst": "x:1", "batches": 1, "ms": 0})
    return Call("trim", [MK.batches, MK.finished], [0])


def trim_idle(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(2)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    c.complete(b, results_for(b))
    return Call("trim", [MK.batches, MK.finished], [0])


def trim_results(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(2)], "j")
    b, _ = c.claim(contract(max_input_len=4096), "w")
    c.complete(b, results_for(b))
    return Call("trim_results", [MK.job_intake("j"), MK.job("j"), MK.job_results("j")],
                [int(time.time() * 1000) + 1000])


_CANCEL_KEYS = [MK.base, MK.state, MK.batches, MK.job("j"), MK.job_items("j"), MK.job_results("j")]
_CANCEL_ARGS = ["j", "m", "cancelled", "the batch was cancelled"]


def _answered(n: int) -> Callable[[redis.Redis], bool]:
    return lambda r: r.hget(MK.job("j"), "failed") == str(n).encode() and r.xlen(MK.job_results("j")) == n


def cancel_waiting(c: Conductor) -> Call:
    """Waiting items of job j answered 'cancelled', the in-flight batch's items left alone."""
    quick(c)
    c.submit([item(i, 10) for i in range(12)], "j")
    assert len(c.claim(contract(4, max_input_len=4096), "w")[0].items) == 4
    return Call("cancel_registry", [*_CANCEL_KEYS, MK.job_sums("j")], [*_CANCEL_ARGS, "0", 1000], check=_answered(8))


def cancel_lane_waiting(c: Conductor) -> Call:
    """Job j's waiting items of a lane answered with their records' tokens, the in-flight ones left alone."""
    quick(c)
    c.submit([item(i, 10) for i in range(12)], "j")
    assert len(c.claim(contract(4, max_input_len=4096), "w")[0].items) == 4
    return Call("cancel_lane", _CANCEL_KEYS, [*_CANCEL_ARGS, f"{inst_of(c)}:0"], check=_answered(8))


def cancel_segment_waiting(c: Conductor) -> Call:
    """Job j's ids waiting in a store segment answered; an in-flight batch read and left alone."""
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    c.claim(contract(4, max_input_len=4096), "w")
    seg, reg = _stored(c, 3)
    reg.run(c.scripts)
    return Call("cancel_segment", _CANCEL_KEYS, [*_CANCEL_ARGS, seg.name], check=_answered(3))


def _pack(c: Conductor, iid: str) -> None:
    """Item ``iid`` of job j, answered, packed (lua/compact_ids.lua): done as much as a done mark."""
    c.r.hset(MK.job_items("j"), iid, "d")
    c.scripts.compact_ids(keys=[MK.job_items("j"), MK.job_sums("j"), MK.job_packed("j"), MK.state], args=[1, 1, iid])


def repair_items_leaked_batch(c: Conductor, packed: bool = False) -> Call:
    """A batch acked but never deleted (leaked), one of its items done; another batch pending."""
    quick(c)
    c.submit([item(i, 10) for i in range(8)], "j")
    b, _ = c.claim(contract(4, max_input_len=4096), "w")
    c.claim(contract(4, max_input_len=4096), "w2")
    c.complete(b, results_for(b)[:1], final=False)
    if packed:
        _pack(c, b.items[0].id)
    c.r.xack(MK.batches, K.GROUP, b.batch_id)
    token = c.r.xrange(MK.batches, b.batch_id, b.batch_id)[0][1][b"k"].decode()
    return Call("repair_items_batch", [MK.base, MK.state, MK.batches, MK.reclaimed],
                [token, b.shape, b.epoch, b.lane, 2, b.batch_id])


def repair_items_packed_in_batch(c: Conductor) -> Call:
    return repair_items_leaked_batch(c, packed=True)


def repair_items_gone_lane(c: Conductor, packed: bool = False) -> Call:
    """A lane of a gone instance, with an item done and a record no job knows."""
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    inst = inst_of(c)
    c.r.delete(MK.inst(inst))
    if packed:
        _pack(c, "0")
    else:
        c.r.hset(MK.job_items("j"), "0", "d")
    c.r.rpush(MK.lane(inst, 0), b'["ghost","nojob",10,5,"p",null]')
    c.r.rpush(MK.lane_tok(inst, 0), 10)
    return Call("repair_items_lane", [MK.base, MK.state, MK.reclaimed], [f"{inst}:0"])


def repair_items_packed_in_gone_lane(c: Conductor) -> Call:
    return repair_items_gone_lane(c, packed=True)


def repair_items_done_in_lane(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    c.r.hset(MK.job_items("j"), "1", "d")
    return Call("repair_items_done", [MK.base, MK.state], [f"{inst_of(c)}:0"])


def repair_items_packed_in_lane(c: Conductor) -> Call:
    """An item answered and packed (lua/compact_ids.lua) that still waits in a lane is done too."""
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    _pack(c, "1")
    return Call("repair_items_done", [MK.base, MK.state], [f"{inst_of(c)}:0"])


def ensure_model_new(c: Conductor) -> Call:
    c.r.hset(MK.cfg, "quiet_ms", 5)  # an operator's value stays
    return Call("ensure_model", [MK.cfg, MK.batches], ["quiet_ms", 1000, "lane_max", 2048])


def ensure_model_known(c: Conductor) -> Call:
    c.ensure_model("m")
    return Call("ensure_model", [MK.cfg, MK.batches], ["quiet_ms", 1000])


def register(c: Conductor) -> Call:
    c.ensure_model("m")
    return Call("register", [MK.workers, MK.cfg, MK.heartbeat("w")], ["w", '{"pid": 1}', 8192, 64, 1, 10000])


def heartbeat(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    b1, _ = c.claim(contract(2, max_input_len=4096), "w")
    b2, _ = c.claim(contract(2, max_input_len=4096), "other")
    return Call("heartbeat", [MK.heartbeat("w"), MK.batches, MK.busy], ["w", 1, 10000, 1500, b1.batch_id, b2.batch_id,
                                                                        "1-0"])


def heartbeat_holding(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    b1, _ = c.claim(contract(2, max_input_len=4096), "w")
    return Call("heartbeat", [MK.heartbeat("w"), MK.batches, MK.busy, MK.holding], ["w", 1, 10000, 1500, b1.batch_id],
                check=lambda r: r.pttl(MK.holding) > 5000)


def _idle_beat(busy: Any = 1500) -> Call:
    return Call("idle_beat", [MK.heartbeat("w"), MK.busy, MK.maint_lease, MK.state, MK.intake, MK.hot, MK.workers],
                ["w", 1, 10000, 5000, busy],
                check=lambda r: r.pttl(MK.heartbeat("w")) > 5000 and r.pttl(MK.maint_lease) > 1000)


def idle_beat_takes_lease(c: Conductor) -> Call:
    quick(c)
    return _idle_beat()


def idle_beat_renews_with_work(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    c.r.set(MK.maint_lease, "w", px=1000)
    return _idle_beat("")


def idle_beat_tells_its_holder_in_flight(c: Conductor) -> Call:
    quick(c)
    c.submit([item(i, 10) for i in range(4)], "j")
    c.claim(contract(2, max_input_len=4096), "other")
    c.r.set(MK.holding, "other", px=10_000)
    return Call("idle_beat", [MK.heartbeat("w"), MK.busy, MK.maint_lease, MK.state, MK.intake, MK.hot, MK.workers,
                              MK.batches, MK.holding], ["w", 1, 10000, 5000, 7],
                check=lambda r: r.get(MK.maint_lease) == b"w")


def idle_beat_tells_its_holder_who_lapsed(c: Conductor) -> Call:
    """A sharded model's own keys (M:beats): a dead worker's entry run out (told, dropped) and a live
    one's run out (dropped, not told); the beat's own entry added."""
    quick(c)
    c.r.zadd(MK.beats, {"dead": 1, "alive": 2, "later": 2 ** 50})
    c.r.set(MK.heartbeat("alive"), 1)
    return Call("idle_beat", [MK.heartbeat("w"), MK.busy, MK.maint_lease, MK.state, MK.intake, MK.hot, MK.workers,
                              MK.batches, MK.holding, MK.beats], ["w", 1, 10000, 5000, 7],
                check=lambda r: r.zrange(MK.beats, 0, -1) == [b"w", b"later"])


def idle_beat_lease_taken(c: Conductor) -> Call:
    quick(c)
    c.r.set(MK.maint_lease, "other", px=5000)
    return Call("idle_beat", [MK.heartbeat("w"), MK.busy, MK.maint_lease, MK.state, MK.intake, MK.hot, MK.workers],
                ["w", 1, 10000, 5000, 7], check=lambda r: r.get(MK.maint_lease) == b"other")


def seal(c: Conductor) -> Call:
    quick(c)
    return Call("seal", [MK.state, MK.intake], [])


def seal_rings(c: Conductor) -> Call:
    quick(c)
    return Call("seal", [MK.state, MK.intake, MK.doorbell], [], check=lambda r: r.llen(MK.doorbell) == 1)


def declare(c: Conductor) -> Call:
    quick(c)
    c.r.hset(MK.job_intake("j"), "declared", 3)
    return Call("declare", [MK.job_intake("j"), MK.state], [5])


def lease_free(c: Conductor) -> Call:
    return Call("lease", [MK.maint_lease], ["w", 5000], check=lambda r: r.get(MK.maint_lease) == b"w")


def lease_mine(c: Conductor) -> Call:
    c.r.set(MK.maint_lease, "w", px=1000)
    return Call("lease", [MK.maint_lease], ["w", 5000], check=lambda r: r.pttl(MK.maint_lease) > 1000)


def lease_handed_back(c: Conductor) -> Call:
    c.r.set(MK.maint_lease, "w", px=5000)
    return Call("lease", [MK.maint_lease], ["w", 0], check=lambda r: not r.exists(MK.maint_lease))


def lease_taken(c: Conductor) -> Call:
    c.r.set(MK.maint_lease, "other", px=5000)
    return Call("lease", [MK.maint_lease], ["w", 5000], check=lambda r: r.get(MK.maint_lease) == b"other")


def _intake_task(c: Conductor, owner: str) -> str:
    from conductor.intake import intake_task as T
    T.create(c, T.Task(job="j", source="cli", path="/nowhere/in.jsonl", state="sending", defaults={}), owner)
    return K.intake_task_key("j")


def _schema_init(c: Conductor) -> Call:
    c.r.delete(K.SCHEMA_KEY)  # Conductor() wrote it
    return Call("schema_init", [K.SCHEMA_KEY, K.MODELS_KEY, K.JOBS_KEY], [6])


def schema_init_empty(c: Conductor) -> Call:
    """An empty Redis gets the current version in one step (lua/schema_init.lua)."""
    call = _schema_init(c)
    return Call(call.script, call.keys, call.args, check=lambda r: r.get(K.SCHEMA_KEY) == b"6")


def schema_init_not_empty(c: Conductor) -> Call:
    """Conductor registries without a version: nothing written (the migrations run instead)."""
    call = _schema_init(c)
    c.r.sadd(K.MODELS_KEY, "m")
    return Call(call.script, call.keys, call.args, check=lambda r: not r.exists(K.SCHEMA_KEY))


def intake_create_new(c: Conductor) -> Call:
    """A task recorded with its creator's lease (lua/intake_create.lua), over an ended one."""
    key = K.intake_task_key("j")
    c.r.hset(key, mapping={"state": "done", "owner": "old", "lease_ms": 0, "line": 9})
    return Call("intake_create", [key], ["first", 5000, "job", "j", "source", "cli", "path", "/in.jsonl",
                                                   "state", "checking", "line", 0],
                check=lambda r: r.hget(key, "owner") == b"first" and r.hget(key, "line") == b"0")


def intake_lease_lapsed(c: Conductor) -> Call:
    """A resumer takes the task whose holder stopped renewing (lua/intake_lease.lua)."""
    key = _intake_task(c, "first")
    c.r.hset(key, "lease_ms", 1)
    return Call("intake_lease", [key], ["second", 5000], check=lambda r: r.hget(key, "owner") == b"second")


def intake_cursor_moves(c: Conductor) -> Call:
    """The holder records a chunk Redis acknowledged (lua/intake_cursor.lua)."""
    key = _intake_task(c, "first")
    return Call("intake_cursor", [key], ["first", 5000, 10, 10, "sending"],
                check=lambda r: r.hget(key, "line") == b"10" and r.hget(key, "sent") == b"10")


def batch_finalize_start(c: Conductor) -> Call:
    """A batch whose lines are all answered reads finalizing (lua/batch_finalize.lua 'start')."""
    key = K.job_meta_key("j")
    c.r.hset(key, mapping={"status": "in_progress", "finalize": "1"})
    return Call("batch_finalize", [key], ["start", 1000], check=lambda r: r.hget(key, "status") == b"finalizing")


def batch_finalize_done(c: Conductor) -> Call:
    """Its files written, the batch is completed with their line counts ('done')."""
    key = K.job_meta_key("j")
    c.r.hset(key, mapping={"status": "finalizing", "finalize": "1"})
    return Call("batch_finalize", [key], ["done", 1001, "output_lines", 3, "error_lines", 1],
                check=lambda r: r.hget(key, "status") == b"completed" and r.hget(key, "output_lines") == b"3")


def tenant_admit_under(c: Conductor) -> Call:
    """A batch within its tenant's enqueued-token limit is counted (lua/tenant_admit.lua)."""
    tk = K.TenantKeys("t")
    c.r.zadd(tk.open, {"batch_a": 40})
    return Call("tenant_admit", [tk.open, tk.opened], ["batch_b", 50, 100, 1000],
                check=lambda r: r.zscore(tk.open, "batch_b") == 50 and r.zscore(tk.opened, "batch_b") == 1000)


def tenant_admit_over(c: Conductor) -> Call:
    """One past the limit is refused, nothing written."""
    tk = K.TenantKeys("t")
    c.r.zadd(tk.open, {"batch_a": 80})
    return Call("tenant_admit", [tk.open, tk.opened], ["batch_b", 50, 100, 1000],
                check=lambda r: r.zscore(tk.open, "batch_b") is None)


def take_name_free(c: Conductor) -> Call:
    return Call("take_name", [MK.base], ["host", 1, 10000, 1000], check=lambda r: r.exists(MK.heartbeat("host")))


def take_name_next(c: Conductor) -> Call:
    c.r.set(MK.heartbeat("host"), 1, px=60_000)
    c.r.set(MK.heartbeat("host-2"), 1, px=60_000)
    return Call("take_name", [MK.base], ["host", 1, 10000, 1000], check=lambda r: r.exists(MK.heartbeat("host-3")))


def take_name_none_free(c: Conductor) -> Call:
    c.r.set(MK.heartbeat("host"), 1, px=60_000)
    return Call("take_name", [MK.base], ["host", 1, 10000, 1], check=lambda r: r.pttl(MK.heartbeat("host")) > 10000)


SCENARIOS: dict[str, list[Callable[[Conductor], Call]]] = {
    "claim": [claim_warming, claim_warmed_shape_activates, claim_reclaimed_part, claim_reclaimed_whole,
              claim_finish_and_next, claim_joins_a_deep_shape, claim_interactive_first, claim_fair_loan,
              claim_fair_switch, claim_aging_preempts, claim_hygiene_drains,
              claim_hygiene_retires_empty,
              claim_hygiene_big_lane, claim_reindexes, claim_enters_cleanup, claim_leaves_cleanup],
    "job_class": [job_class_new],
    "intake_create": [intake_create_new],
    "schema_init": [schema_init_empty, schema_init_not_empty],
    "intake_lease": [intake_lease_lapsed],
    "intake_cursor": [intake_cursor_moves],
    "submit": [submit_new_shapes, submit_leaves_cleanup_reuses_lane, submit_known_shape_without_prefix,
               submit_from_store],
    "register_segment": [register_segment_new],
    "fail_stored": [fail_stored],
    "offload_results": [offload_results],
    "compact_ids": [compact_ids],
    "complete": [complete_final, complete_retired, complete_request],
    "reclaim": [reclaim_dead_consumer],
    "fail": [fail_requeues, fail_dead_letters],
    "dead_retry": [dead_retry, dead_retry_packed],
    "reindex": [reindex],
    "repair": [repair, repair_unstaged, repair_gone_instance],
    "repair_items_batch": [repair_items_leaked_batch, repair_items_packed_in_batch],
    "repair_items_lane": [repair_items_gone_lane, repair_items_packed_in_gone_lane],
    "repair_items_done": [repair_items_done_in_lane, repair_items_packed_in_lane],
    "trim": [trim_pending, trim_idle],
    "trim_results": [trim_results],
    "ensure_model": [ensure_model_new, ensure_model_known],
    "register": [register],
    "heartbeat": [heartbeat, heartbeat_holding],
    "idle_beat": [idle_beat_takes_lease, idle_beat_renews_with_work, idle_beat_lease_taken,
                  idle_beat_tells_its_holder_in_flight, idle_beat_tells_its_holder_who_lapsed],
    "seal": [seal, seal_rings],
    "declare": [declare],
    "lease": [lease_free, lease_mine, lease_taken, lease_handed_back],
    "take_name": [take_name_free, take_name_next, take_name_none_free],
    "cancel_registry": [cancel_waiting],
    "cancel_lane": [cancel_lane_waiting],
    "cancel_segment": [cancel_segment_waiting],
    "batch_finalize": [batch_finalize_start, batch_finalize_done],
    "tenant_admit": [tenant_admit_under, tenant_admit_over],
    "hand_over": [hand_over],
    "hand_in": [hand_in],
}


# ------------------------------------------------------------------ what a script may call

_CALL = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?")
_SUBCOMMANDS = {"XGROUP", "XINFO"}


def _commands(text: str) -> set[str]:
    out = set()
    for m in _CALL.finditer(text):
        cmd = m.group(1).lower()
        if m.group(1).upper() in _SUBCOMMANDS and m.group(2):
            cmd += "|" + m.group(2).lower()
        out.add(cmd)
    return out


def script_commands(name: str) -> set[str]:
    """Every command ``name`` may call: its own source and the functions of its includes (lib.lua,
    lib_requeue.lua, claim.lua's, nested ones) that it uses, transitively; names as ACL and INFO
    commandstats spell them."""
    text = (LUA / f"{name}.lua").read_text()
    included: list[str] = []

    def read(file: str) -> str:
        included.append(file)
        return scripts._read(file)

    scripts.expand(f"{name}.lua", read)
    funcs: dict[str, str] = {}
    for file in included[1:]:
        lib = read(file)
        funcs.update({m.group(1): m.group(0)
                      for m in re.finditer(r"^local function (\w+)\(.*?(?=^local |\Z)", lib, re.M | re.S)})
    used: set[str] = set()
    todo = [text]
    while todo:
        t = todo.pop()
        for f, body in funcs.items():
            if f not in used and re.search(rf"\b{f}\(", t):
                used.add(f)
                todo.append(body)
    out = _commands(text)
    for f in used:
        out |= _commands(funcs[f])
    return out


def scripts_in_lua() -> list[str]:
    return sorted(p.stem for p in LUA.glob("*.lua") if not p.stem.startswith("lib"))


# ------------------------------------------------------------------ database fingerprint, snapshot

def fingerprint(r: redis.Redis) -> tuple:
    """DEBUG DIGEST (every key's value and type) plus each stream's groups, consumers and pending
    entries, which DEBUG DIGEST leaves out on Redis 7.0."""
    streams = sorted(k for k in r.scan_iter(count=1000, _type="stream"))
    return (r.execute_command("DEBUG", "DIGEST"),
            tuple(repr(r.execute_command("XINFO", "STREAM", k, "FULL")) for k in streams))


def snapshot(r: redis.Redis) -> list[tuple[bytes, int, bytes]]:
    return [(k, max(0, r.pttl(k)), r.dump(k)) for k in r.scan_iter(count=1000)]


def restore(r: redis.Redis, snap: list[tuple[bytes, int, bytes]]) -> None:
    r.flushall()
    for k, ttl, blob in snap:
        r.restore(k, ttl, blob)


def run(r: redis.Redis, call: Call) -> Any:
    """The call's reply, or the ResponseError it raised."""
    sha = r.script_load(source(call.script))
    try:
        return r.evalsha(sha, len(call.keys), *call.keys, *call.args)
    except redis.ResponseError as e:
        return e


def called(r: redis.Redis, call: Call) -> tuple[Any, set[str]]:
    """Runs ``call`` and returns its reply and the commands it called (INFO commandstats)."""
    sha = r.script_load(source(call.script))
    r.config_resetstat()
    try:
        reply: Any = r.evalsha(sha, len(call.keys), *call.keys, *call.args)
    except redis.ResponseError as e:
        reply = e
    stats = r.info("commandstats")
    names = {k.removeprefix("cmdstat_") for k in stats} - {"evalsha", "config|resetstat", "info"}
    return reply, names
