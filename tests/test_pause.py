"""conductor pause: every script that writes a model's keys refuses, nothing written, until
resume; producers get Paused, workers ride it out and lose nothing."""

import json

import pytest
import redis

from conductor.errors import Paused
from conductor.jobs.deadletter import DeadLetter
from conductor.redis_contract.records import Contract
from tests.conftest import cli, item
from tests.helpers import MK, drain, quick, results_for
from tests.worker_kit import run_until_done, submit, worker

C = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)

def dump(r) -> dict:
    return {k: r.dump(k) for k in r.scan_iter(match="cdr:{m}:*", count=1000)}


def test_a_paused_model_refuses_every_write_and_resume_finishes_the_job(cdr, redis_url):
    quick(cdr, max_deliveries=1)
    cdr.submit([item(i, 10) for i in range(20)], "j")
    inflight, _ = cdr.claim(C, "w")
    doomed, _ = cdr.claim(C, "gone")  # a dead consumer's batch: dead-lettered (max_deliveries 1)
    cdr.reclaim_consumer("m", "gone", force=True)
    dead_ids = [eid for eid, _ in cdr.r.xrange(MK.dead)]
    assert dead_ids
    assert b"paused" in cli("pause", "m", url=redis_url).stdout
    assert b"PAUSED" in cli("inspect", "m", url=redis_url).stdout
    before = dump(cdr.r)
    with pytest.raises(Paused):
        cdr.submit([item(i, 10) for i in range(20, 30)], "j")
    assert cdr.claim(C, "w") == (None, "paused")
    with pytest.raises(Paused):
        cdr.complete(inflight, results_for(inflight))
    keys5 = [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed]
    for script, keys, args in [(cdr.scripts.fail, keys5, [inflight.batch_id, "w", "boom"]),
                               (cdr.scripts.reclaim, keys5, ["gone", 1, 0, 10]),
                               (cdr.scripts.reindex, [MK.base, MK.cfg, MK.state], [f"{inflight.shape}:1"]),
                               (cdr.scripts.repair, [MK.base, MK.cfg, MK.state], [f"{inflight.shape}:1"]),
                               (cdr.scripts.dead_retry, [MK.base, MK.state, MK.dead, MK.reclaimed], dead_ids)]:
        with pytest.raises(redis.ResponseError, match="^PAUSED"):
            script(keys=keys, args=args)
    assert dump(cdr.r) == before  # nothing written by any of them
    assert b"resumed" in cli("resume", "m", url=redis_url).stdout
    cdr.complete(inflight, results_for(inflight))
    cdr.submit([item(i, 10) for i in range(20, 30)], "j")
    drain(cdr, C)
    assert DeadLetter(cdr).retry(model="m")["retried"] == len(doomed.items)
    drain(cdr, C)
    ids = sorted(int(r.id) for r in cdr.read_results("j"))
    assert ids == list(range(30))


def test_a_worker_rides_a_pause_out_and_writes_its_results_after_resume(cdr):
    submit(cdr, 12, tokens=10, max_tokens=4)
    w = worker(cdr)
    w.turn()
    assert w.batches_claimed == 1
    cdr.pause("m")
    for _ in range(10):
        w.turn()  # the batch finishes; its write is refused and kept; no new claim
    assert len(w.retry) == 1 and w.batches_claimed == 1
    assert cdr.r.xlen(MK.job_results("j")) == 0
    cdr.resume("m")
    run_until_done(w)
    rows = [json.loads(r) for r in cdr.results("j")]
    assert sorted(r["id"] for r in rows) == [f"i{k:04d}" for k in range(12)]


def test_a_worker_with_idle_exit_waits_out_a_pause_instead_of_exiting(cdr):
    import threading
    import time
    submit(cdr, 8, tokens=10, max_tokens=4)
    cdr.pause("m")
    w = worker(cdr, idle_exit_s=0.3)
    t = threading.Thread(target=w.run)
    t.start()
    time.sleep(1.0)
    assert t.is_alive()  # paused for three times its idle limit, still there
    cdr.resume("m")
    t.join(20)
    assert not t.is_alive()  # finished the job, then idle: it exits
    assert cdr.status("j")["done"]
