"""Issue 25: a job larger than Redis memory drains through a Redis of fixed size.

30,000 small items through a Redis capped at 16 MB (noeviction) with the disk tier on, two sim
workers and a following reader (bench/memory_cap.py, real processes). Before the change the job's
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

from bench.memory_cap import run
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
