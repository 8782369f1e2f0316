"""conductor/verify/: every counter against the data it counts, on a real redis-server."""

from __future__ import annotations

import json

from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
from conductor.verify import repair, verify
from tests.conftest import item
from tests.helpers import quick, results_for

C = Contract(model="m", max_batch_size=8, max_batch_tokens=4096, max_input_len=4096)


def _submit_mix(cdr, n=40, job="j"):
    items = [item(i, 10 + (i * 37) % 300, prefix=(f"sys{i % 3}",)) for i in range(n)]
    return cdr.submit(items, job)


def _drift(report):
    return [(r.key, r.field, r.recorded, r.truth) for r in report.drift]


def test_fresh_queue_has_no_drift_and_counts_what_waits(cdr):
    quick(cdr)
    _submit_mix(cdr)
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (_drift(rep), rep.problems)
    st = {r.field: (r.recorded, r.truth) for r in rep.rows if r.key == K.ModelKeys("m").intake}
    assert st["items"] == (40, 40) and st["submitted"] == (40, 40)
    assert st["tokens"][1] == sum(10 + (i * 37) % 300 for i in range(40))
    kinds = {r.kind for r in rep.rows}
    assert {"lane.items", "lane.tokens", "fill.member", "inst.tokens", "staged.score", "job.submitted"} <= kinds


def test_claims_completions_failures_and_reclaims_keep_zero_drift(cdr):
    quick(cdr, max_deliveries=2)
    _submit_mix(cdr)
    mk = K.ModelKeys("m")
    b1, _ = cdr.claim(C, "a")
    b2, _ = cdr.claim(C, "b")
    b3, _ = cdr.claim(C, "a")
    assert b1 and b2 and b3
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (_drift(rep), rep.problems)
    inflight = {r.field: r.truth for r in rep.rows if r.key == mk.state}
    assert inflight["inflight_batches"] == 3
    assert inflight["inflight_items"] == len(b1.items) + len(b2.items) + len(b3.items)
    cdr.complete(b1, results_for(b1, "a")[:1], final=False)  # partial
    cdr.complete(b2, results_for(b2, "b", error=True))
    cdr.fail(b3, "a", "engine broke")
    cdr.reclaim_consumer("m", "a")  # no heartbeat: dead; b1 goes back minus its written result
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (_drift(rep), rep.problems)
    st = {r.field: r.truth for r in rep.rows if r.key == mk.state}
    assert st["failed"] == len(b2.items) and st["completed"] == 1
    assert st["reclaimed_items"] == len(b1.items) - 1 + len(b3.items)
    # each reclaimed entry lists a token per item record
    assert {(r.key, r.field): r.recorded for r in rep.rows}[(mk.reclaimed, "tokens listed")] == st["reclaimed_items"]
    assert st["inflight_batches"] == 0


def test_corrupted_counters_are_caught_and_repaired(cdr):
    quick(cdr)
    _submit_mix(cdr)
    b, _ = cdr.claim(C, "a")
    cdr.complete(b, results_for(b, "a")[:2], final=False)
    mk = K.ModelKeys("m")
    assert verify(cdr.r, "m").ok
    inst = f"{b.shape}:{b.epoch}"
    other = next(i for i in (x.decode() for x in cdr.r.zrange(mk.staged, 0, -1)) if i != inst)
    lane0 = next(x.decode() for x in cdr.r.zrange(mk.inst_fill(other), 0, 0))
    cdr.r.hincrby(mk.intake, "tokens", 7)
    cdr.r.hincrby(mk.state, "inflight_items", -1)
    cdr.r.hincrby(mk.inst(other), "items", 3)
    cdr.r.hincrby(mk.lanemeta(other, lane0), "tokens", 5)
    cdr.r.zadd(mk.staged, {other: 1})
    cdr.r.zrem(mk.inst_fill(other), lane0)
    cdr.r.hincrby(mk.job("j"), "completed", 1)
    drift = {(r.key, r.field): r.diff for r in verify(cdr.r, "m").drift}
    assert drift == {
        (mk.intake, "tokens"): 7,
        (mk.state, "inflight_items"): -1,
        (mk.inst(other), "items"): 3,
        (mk.lanemeta(other, lane0), "tokens"): 5,
        (mk.staged, f"{other} score"): 1 - int(cdr.r.hget(mk.inst(other), "tokens")),
        (mk.inst_fill(other), f"lane {lane0} member"): -1,
        (mk.job("j"), "completed"): 1,
        # the model's totals are checked against the sum of the next level's counters
        (mk.intake, "items"): -3,
        (mk.state, "completed"): -1,
    }
    changes, failed = repair(cdr.r, "m")
    assert not failed
    changed = {(c.key, c.field) for c in changes}
    assert (mk.intake, "tokens") in changed and (mk.lanemeta(other, lane0), "tokens") in changed
    assert (mk.job("j"), "completed") in changed and (mk.state, "completed") not in changed
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (_drift(rep), rep.problems)
    # repaired counters drive the queue as before: everything drains, nothing lost
    from tests.helpers import drain
    cdr.complete(b, results_for(b, "a"))
    drain(cdr, C, "a")
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (_drift(rep), rep.problems)
    assert cdr.status("j")["done"]


def _a_waiting_lane(cdr) -> tuple[K.ModelKeys, str, str]:
    """Ten items submitted; the model's keys, a staged instance and one of its lanes."""
    quick(cdr)
    _submit_mix(cdr, n=10)
    mk = K.ModelKeys("m")
    inst = next(x.decode() for x in cdr.r.zrange(mk.staged, 0, 0))
    return mk, inst, next(x.decode() for x in cdr.r.zrange(mk.inst_fill(inst), 0, 0))


def test_ledger_finds_lost_and_duplicated_items(cdr):
    mk, inst, lane = _a_waiting_lane(cdr)
    rec = cdr.r.lindex(mk.lane(inst, lane), 0)
    tok = cdr.r.lindex(mk.lane_tok(inst, lane), 0)
    iid = json.loads(rec)[0]
    cdr.r.rpush(mk.lane(inst, lane), rec)  # the same item twice in its lane (token list kept parallel)
    cdr.r.rpush(mk.lane_tok(inst, lane), tok)
    rep = verify(cdr.r, "m", items=True)
    assert any("duplicated" in p and iid in p for p in rep.problems)
    assert (mk.lane_tok(inst, lane), "length") not in {(r.key, r.field) for r in rep.drift}
    assert cdr.r.lrem(mk.lane(inst, lane), 0, rec) == 2  # both copies gone
    cdr.r.lpop(mk.lane_tok(inst, lane))
    cdr.r.rpop(mk.lane_tok(inst, lane))
    rep = verify(cdr.r, "m", items=True)
    assert any("lost" in p and iid in p for p in rep.problems)
    assert (mk.lanemeta(inst, lane), "items") in {(r.key, r.field) for r in rep.drift}


def test_token_list_is_checked_against_the_records_and_repair_refuses_uneven_lanes(cdr):
    mk, inst, lane = _a_waiting_lane(cdr)
    lk, tk = mk.lane(inst, lane), mk.lane_tok(inst, lane)
    n = cdr.r.llen(lk)
    assert n and cdr.r.llen(tk) == n
    assert [int(t) for t in cdr.r.lrange(tk, 0, -1)] == [json.loads(x)[2] for x in cdr.r.lrange(lk, 0, -1)]
    assert verify(cdr.r, "m").ok
    last = int(cdr.r.lindex(tk, -1))
    cdr.r.lset(tk, -1, last - 1)  # a token that no longer matches its record
    drift = {(r.key, r.field): r.diff for r in verify(cdr.r, "m").drift}
    assert drift[(tk, f"token {n - 1}")] == -1
    assert drift[(mk.lanemeta(inst, lane), "tokens")] == 1  # the meta against the token list
    cdr.r.lset(tk, -1, last)
    assert verify(cdr.r, "m").ok

    cdr.r.rpush(tk, 5)  # a token without an item
    cdr.r.hincrby(mk.lanemeta(inst, lane), "items", 1)
    drift = {(r.key, r.field): r.diff for r in verify(cdr.r, "m").drift}
    assert drift[(tk, "length")] == 1
    changes, failed = repair(cdr.r, "m")
    assert any(mk.inst(inst) in f and "ERR_STATE lane" in f for f in failed), failed
    assert all(c.key != mk.lanemeta(inst, lane) for c in changes)  # that instance: nothing written
    assert int(cdr.r.hget(mk.lanemeta(inst, lane), "items")) == n + 1
    cdr.r.rpop(tk)
    changes, failed = repair(cdr.r, "m")
    assert not failed and (mk.lanemeta(inst, lane), "items") in {(c.key, c.field) for c in changes}
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (_drift(rep), rep.problems)


def test_results_trimmed_by_retention_are_checked_by_their_sum(cdr):
    from conductor.jobs.retention import trim_job_results
    from tests.helpers import drain
    quick(cdr)
    _submit_mix(cdr, n=12)
    batches = drain(cdr, C, "a", complete=False)
    for i, b in enumerate(batches):
        cdr.complete(b, results_for(b, "a", error=i == 0))
    assert verify(cdr.r, "m").ok
    assert trim_job_results(cdr, "j", 10**13) == 12
    mk = K.ModelKeys("m")
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (_drift(rep), rep.problems)
    fields = {(r.key, r.field): (r.recorded, r.truth) for r in rep.rows}
    assert fields[(mk.job("j"), "completed+failed")] == (12, 12)
    assert (mk.job("j"), "completed") not in fields
    cdr.r.hincrby(mk.job("j"), "failed", 1)
    assert [(r.key, r.field, r.diff) for r in verify(cdr.r, "m").drift] == [
        (mk.job("j"), "completed+failed", 1), (mk.state, "failed", -1)]
