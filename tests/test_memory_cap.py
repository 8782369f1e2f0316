"""Issue 25: a job larger than Redis memory drains through a Redis of fixed size.

30,000 small items through a Redis capped at 16 MB (noeviction) with the disk tier on, two sim
workers and a following reader (bench/memory/memory_cap.py, real processes). Before the change the job's
results stream filled Redis, every feed of the waiting backlog was refused and the job stopped
near 26,000 results with the worker logging ``feed_failed`` in a loop; now the lease holder moves
results to the store as Redis nears its cap, and every id comes out once.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
from prometheus_client import REGISTRY

from bench.memory.memory_cap import run
from conductor.client import Conductor
from conductor.embedded import EmbeddedRedis
from conductor.errors import QueueFull
from conductor.redis_contract import keys as K
from conductor.redis_contract.packed_ids import packed_count
from conductor.redis_contract.records import Contract
from conductor.tier.object_store import Store
from conductor.tier.result_segments import offload_model
from conductor.tier.room import ROOM_WINDOW, make_room
from conductor.workers.feed_stall import FeedStall
from tests.conftest import item
from tests.helpers import drain, quick


def test_a_job_larger_than_redis_drains_through_a_capped_redis_with_a_following_reader(tmp_path):
    res = run(30_000, "16mb", tmp_path, stall_s=20.0, timeout_s=120.0)
    assert res.drained, (res.stalled, res.results, res.duplicates, res.by_kind, res.tail)
    assert res.results == 30_000 and res.duplicates == 0
    # answered ids were packed (conductor/tier/compact_ids.py): the registry left as the job drained
    assert res.by_kind.get("cdr:M:job:J:packed", 0) > 0, res.by_kind
    assert sum(res.by_kind.values()) < 16 * 2**20, res.by_kind


def test_making_room_moves_results_to_the_store_and_a_reader_reads_each_once(tmp_path):
    with EmbeddedRedis() as srv:
        c = Conductor.from_url(srv.url, store=Store(str(tmp_path / "store")))
        quick(c)
        c.submit([item(f"r{i}", 10 + i % 30) for i in range(1200)], "j")
        drain(c, Contract(model="m", max_batch_size=64, max_batch_tokens=65536, max_input_len=4096))
        reader = c.results("j", follow=True, block_ms=100)
        first = [json.loads(next(reader))["id"] for _ in range(300)]  # a follower, part way
        assert make_room(c, c.tier.store, "m") == (1200 - ROOM_WINDOW) + 1200  # results moved, ids packed
        mk = K.ModelKeys("m")
        assert c.r.xlen(mk.job_results("j")) == ROOM_WINDOW and c.r.llen(mk.job_rsegs("j")) >= 1
        assert c.r.hlen(mk.job_items("j")) == 0 and packed_count(c.r, mk, "j") == 1200
        rest = [json.loads(rec)["id"] for rec in reader]
        assert sorted(first + rest) == sorted(f"r{i}" for i in range(1200))  # each once, from both
        again = [json.loads(rec)["id"] for rec in c.results("j")]
        assert sorted(again) == sorted(first + rest)


@pytest.mark.slow
def test_a_job_of_250000_items_drains_through_64mb(tmp_path):
    res = run(250_000, "64mb", tmp_path, stall_s=60.0, timeout_s=900.0)
    assert res.drained, (res.stalled, res.results, res.duplicates, res.by_kind, res.tail)


def test_results_older_than_results_age_s_move_to_the_store(tmp_path):
    with EmbeddedRedis() as srv:
        c = Conductor.from_url(srv.url, store=Store(str(tmp_path / "store")))
        quick(c, results_age_s=1)
        c.submit([item(f"a{i}", 10 + i % 30) for i in range(300)], "j")
        drain(c, Contract(model="m", max_batch_size=64, max_batch_tokens=65536, max_input_len=4096))
        mk = K.ModelKeys("m")
        assert offload_model(c, c.tier.store, "m") == 0  # younger than a second: they stay
        deadline = time.monotonic() + 30
        while c.r.xlen(mk.job_results("j")) and time.monotonic() < deadline:
            offload_model(c, c.tier.store, "m")  # as the lease holder's sweep does, each second
            time.sleep(0.2)
        assert c.r.xlen(mk.job_results("j")) == 0 and c.r.llen(mk.job_rsegs("j")) >= 1
        ids = [json.loads(rec)["id"] for rec in c.results("j")]
        assert sorted(ids) == sorted(f"a{i}" for i in range(300))


def _sample(name: str, model: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": model, "worker": "w1"})


def test_a_refused_feed_is_one_line_when_the_stall_starts_and_one_when_it_ends(caplog):
    caplog.set_level(logging.INFO, logger="conductor.maintenance")
    stall = FeedStall("stall-m", "w1")
    assert _sample("conductor_feed_stalled", "stall-m") == 0
    err = QueueFull("Redis is full (maxmemory reached)")
    assert stall.failed(err) is True
    for _ in range(500):  # the loop that logged 11,365 lines: silent now
        assert stall.failed(err) is False
    assert _sample("conductor_feed_stalled", "stall-m") == 1
    assert (_sample("conductor_feed_stall_age_seconds", "stall-m") or 0) >= 0
    assert _sample("conductor_feed_failures_total", "stall-m") == 501
    stall.ok()
    stall.ok()  # no stall: no line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert '"feed_stalled"' in lines[0] and '"feed_resumed"' in lines[1] and '"refused_feeds": 501' in lines[1]
    assert _sample("conductor_feed_stalled", "stall-m") == 0
    assert _sample("conductor_feed_stall_age_seconds", "stall-m") == 0
    # a stall inside a Redis outage (the worker said so in its own line): no line here either way
    assert stall.failed(err, say=False) is True and _sample("conductor_feed_stalled", "stall-m") == 1
    stall.ok()
    assert len(caplog.records) == 2 and _sample("conductor_feed_stalled", "stall-m") == 0


def test_a_backlog_submitted_before_any_worker_fits_a_small_redis_and_drains_once(tmp_path):
    """Backlog first, then the fleet: 50,000 items submitted with no worker running into a Redis
    capped at 6 MB. A registry entry per store-waiting id (about 80 bytes, schema 5) would need
    some 3.6 MB for the ids alone over an empty server of about 1.3 MB (estimated, not run here);
    the packed stored ids (16 bytes) and the segments' id lists hold them in about 40 bytes each
    (the last assert), and two workers then drain every id once. At 5 MB the drain stalled on a busy
    machine (load average 8: the feed's 5,000-item calls waiting in client buffers count against
    maxmemory), with nothing left to move to the store."""
    res = run(50_000, "6mb", tmp_path, stall_s=60.0, timeout_s=300.0, order="backlog-first")
    assert res.drained, (res.stalled, res.results, res.duplicates, res.by_kind, res.tail)
    assert res.results == 50_000 and res.duplicates == 0
    assert res.stored_items > 45_000  # all but what the lanes hold waited in the store
    assert res.bytes_per_stored < 60, res.bytes_per_stored  # lanes and segment records included


def test_store_waiting_ids_are_duplicates_or_conflicts_and_a_cancel_answers_them_once(tmp_path):
    from conductor.errors import Conflict
    from conductor.jobs.job_state import cancel
    from conductor.redis_contract.packed_ids import stored_count
    from conductor.tier.feeder import Feeder
    from conductor.verify import verify

    with EmbeddedRedis() as srv:
        c = Conductor.from_url(srv.url, store=Store(str(tmp_path / "store")))
        quick(c, resident_tokens=500)
        mk = K.ModelKeys("m")
        its = [item(f"b{i}", 50, prefix=(f"s{i % 2}",)) for i in range(100)]
        assert c.submit(its, "j").accepted == 100
        assert stored_count(c.r, mk, "j") == 90 and c.r.hlen(mk.job_sums("j")) == 10  # 10 in lanes
        # the same items again: every one a duplicate (lanes and store alike), nothing more stored
        again = c.submit(its, "j")
        assert (again.accepted, again.duplicates) == (0, 100) and stored_count(c.r, mk, "j") == 90
        # a stored id with other content: a conflict, nothing written (the pre-check and submit.lua)
        with pytest.raises(Conflict):
            c.submit([item("b57", 51, prefix=("s1",))], "j")
        from conductor.redis_contract import script_calls as calls
        with pytest.raises(Conflict):
            calls.submit(mk, "j", [item("b57", 51, prefix=("s1",))]).run(c.scripts)
        assert stored_count(c.r, mk, "j") == 90
        rep = verify(c.r, "m", items=True)
        assert rep.ok and rep.ledger["stored"] == 90, (rep.drift, rep.problems, rep.ledger)
        # cancel answers the stored ids from their segments' id lists, each once; the feed then places none
        cancel(c, "j")
        ids = [json.loads(rec)["id"] for rec in c.results("j")]
        assert sorted(ids) == sorted(it.id for it in its)
        feeder = Feeder(c, c.tier.store, "m")
        while c.r.zcard(mk.segs):
            feeder.feed()
        assert stored_count(c.r, mk, "j") == 0 and int(c.r.hget(mk.intake, "stored_items")) == 0
        assert len(list(c.results("j"))) == 100
        rep = verify(c.r, "m", items=True)
        assert rep.ok, (rep.drift, rep.problems)
        # the emptied stored form (empty buckets: a producer's ACL has no HDEL) is deleted by the lease
        # holder's compaction pass; a job that still has stored ids keeps it
        from conductor.tier.compact_ids import compact_model
        assert c.r.exists(mk.job_stored("j"))
        c.submit([item(f"k{i}", 50, prefix=("s0",)) for i in range(100)], "k")
        assert stored_count(c.r, mk, "k") > 0
        compact_model(c, "m")
        assert not c.r.exists(mk.job_stored("j")) and stored_count(c.r, mk, "j") == 0
        assert c.r.exists(mk.job_stored("k"))
        assert verify(c.r, "m", items=True).ok
