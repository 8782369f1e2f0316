"""Chaos on real processes: 4 `conductor worker` processes, a random one SIGKILLed about every
2 s and replaced; the producer submits while they run; Redis (AOF, appendfsync always) is
SIGKILLed and restarted in the middle. Counts items lost, duplicate results, items
dead-lettered and the time to finish; lost and duplicates must be 0.

    .venv/bin/python -m pytest -q -s -m chaos tests/test_chaos.py     # the long form, 20,000 items
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.errors import RedisUnavailable
from conductor.redis_contract import keys as K
from tests.conftest import ROOT, item

MODEL = "chaos"
JOB = "chaos"


@dataclass
class Figures:
    items: int
    seconds: float = 0.0
    lost: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    worker_kills: int = 0
    redis_kills: int = 0
    reclaimed_batches: int = 0
    requeued_items: int = 0
    max_deliveries_seen: int = 0
    stored_peak: int = 0  # with the disk tier: the most items seen waiting in store segments
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"chaos: {self.items} items, {self.worker_kills} worker SIGKILLs, {self.redis_kills} Redis SIGKILL: "
                f"lost {self.lost}, duplicate results {self.duplicates}, dead-lettered {self.dead_lettered}, "
                f"reclaimed batches {self.reclaimed_batches} ({self.requeued_items} items requeued), "
                f"max deliveries {self.max_deliveries_seen}, finished in {self.seconds:.1f} s"
                + (f", up to {self.stored_peak} items in store segments" if self.stored_peak else ""))


class Fleet:
    """Worker processes under test; each replacement gets a new name, as a restarted pod would."""

    def __init__(self, url: str, logs: Path, time_scale: float, store: Path | None = None) -> None:
        self.url, self.logs, self.time_scale = url, logs, time_scale
        self.store = ["--store", str(store)] if store else []  # the disk tier (conductor/tier/spill.py)
        self.procs: list[subprocess.Popen] = []
        self.spawned = 0

    def spawn(self) -> subprocess.Popen:
        self.spawned += 1
        name = f"cw{self.spawned}"
        log = open(self.logs / f"{name}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "conductor", "--redis", self.url, *self.store,
                              "--log-level", "warning", "worker", "--engine", "sim", "--model", MODEL, "--name", name,
                              "--max-batch-size", "64", "--max-batch-tokens", "8192", "--heartbeat-ttl", "1.0",
                              "--high-water", "256", "--low-water", "128",
                              "--sim-time-scale", str(self.time_scale)],
                             cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        return p

    def start(self, n: int) -> None:
        self.procs = [self.spawn() for _ in range(n)]

    def kill_one(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.procs))
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait()
        self.procs[i] = self.spawn()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def produce(cdr: Conductor, n: int, rng: random.Random, chunk: int = 1000) -> None:
    """Submit in chunks while everything breaks; a chunk cut off by the Redis kill is sent again
    (submission is idempotent on the item id)."""
    for start in range(0, n, chunk):
        its = [item(f"c{i}", max(1, int(rng.lognormvariate(4.0, 0.6))), model=MODEL, max_tokens=48,
                    prefix=(f"system {i % 7}",)) for i in range(start, min(n, start + chunk))]
        while True:
            try:
                cdr.submit(its, JOB)
                break
            except (RedisUnavailable, redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.2)
        time.sleep(0.05)


def run_chaos(tmp_path: Path, n: int, *, workers: int = 4, time_scale: float, kill_every: float = 2.0,
              redis_kill_at: float = 0.4, timeout: float = 600.0, seed: int = 5,
              resident_tokens: int = 0) -> Figures:
    """``resident_tokens``: with the disk tier, a store in tmp_path and that ceiling."""
    rng = random.Random(seed)
    (tmp_path / "redis").mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    srv = EmbeddedRedis(appendonly=True, appendfsync="always", dir=str(tmp_path / "redis")).start()
    fig = Figures(items=n)
    store = tmp_path / "store" if resident_tokens else None
    fleet = Fleet(srv.url, logs, time_scale, store)
    try:
        from conductor.tier.object_store import Store
        cdr = Conductor(connect(srv.url), store=Store(str(store)) if store else None)
        cdr.set_config(MODEL, {"quiet_ms": 300, "resident_tokens": resident_tokens})
        t0 = time.monotonic()
        producer = threading.Thread(target=produce, args=(cdr, n, random.Random(seed + 1)))
        producer.start()
        fleet.start(workers)
        next_kill = time.monotonic() + kill_every * rng.uniform(0.75, 1.25)
        while True:
            assert time.monotonic() - t0 < timeout, f"not finished in {timeout}s: {safe_status(cdr)}"
            st = safe_status(cdr)
            done = st.get("completed", 0) + st.get("failed", 0)
            if store:
                try:
                    fig.stored_peak = max(fig.stored_peak, int(cdr.r.hget(K.ModelKeys(MODEL).intake,
                                                                         "stored_items") or 0))
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
            if not producer.is_alive() and st.get("submitted") == n and st.get("pending") == 0:
                break
            if fig.redis_kills == 0 and done >= redis_kill_at * n:
                srv.kill()
                fig.redis_kills += 1
                time.sleep(0.5)
                srv.start()
            if time.monotonic() >= next_kill:
                fleet.kill_one(rng)
                fig.worker_kills += 1
                next_kill = time.monotonic() + kill_every * rng.uniform(0.75, 1.25)
            for i, p in enumerate(fleet.procs):  # a worker that gave up (it should not) is replaced
                if p.poll() is not None:
                    fig.notes.append(f"worker exited {p.returncode} on its own")
                    fleet.procs[i] = fleet.spawn()
            time.sleep(0.1)
        fig.seconds = time.monotonic() - t0
        producer.join()
        fleet.stop()
        tally(cdr, n, fig)
    finally:
        fleet.stop()
        srv.close()
    print("\n" + fig.line() + ("; notes: " + "; ".join(sorted(set(fig.notes))) if fig.notes else ""))
    return fig


def safe_status(cdr: Conductor) -> dict:
    try:
        return cdr.status(JOB)
    except (RedisUnavailable, redis.ConnectionError, redis.TimeoutError):
        return {}


def tally(cdr: Conductor, n: int, fig: Figures) -> None:
    rows = cdr.read_results(JOB)
    ids = Counter(r.id for r in rows)
    expected = {f"c{i}" for i in range(n)}
    fig.lost = len(expected - set(ids))
    fig.duplicates = sum(c - 1 for c in ids.values())
    assert set(ids) <= expected
    mk = K.ModelKeys(MODEL)
    fig.dead_lettered = cdr.r.xlen(mk.dead)
    state = {k.decode(): v.decode() for k, v in cdr.r.hgetall(mk.state).items()}
    fig.reclaimed_batches = int(state.get("reclaims", 0))
    fig.requeued_items = int(state.get("requeued_items", 0))
    fig.max_deliveries_seen = max((r.deliveries for r in rows), default=0)
    st = cdr.status(JOB)
    assert (st["submitted"], st["completed"] + st["failed"], st["pending"]) == (n, n, 0)
    assert st["failed"] == fig.dead_lettered  # the sim engine fails nothing: every failure is a dead letter


def test_chaos_short(tmp_path):
    fig = run_chaos(tmp_path, 3000, time_scale=2.0, timeout=240, kill_every=1.0)  # full batches finish it sooner
    assert fig.worker_kills >= 3 and fig.redis_kills == 1
    assert fig.reclaimed_batches > 0  # the kills did land on work in flight
    assert (fig.lost, fig.duplicates) == (0, 0)


@pytest.mark.chaos
def test_chaos_long(tmp_path):
    # 60,000 items: about a minute on key schema 2 (20,000 took 18 s, too few kills to mean much)
    fig = run_chaos(tmp_path, 60_000, time_scale=1.0, timeout=1200)
    assert fig.worker_kills >= 15 and fig.redis_kills == 1
    assert (fig.lost, fig.duplicates) == (0, 0)


@pytest.mark.chaos
def test_chaos_with_the_store_in_use(tmp_path):
    """The same chaos with the disk tier: most of the backlog waits in store segments, fed by
    whichever worker holds the lease while workers and Redis are SIGKILLed."""
    fig = run_chaos(tmp_path, 6000, time_scale=2.0, timeout=400, kill_every=1.0, resident_tokens=20_000)
    assert fig.worker_kills >= 3 and fig.redis_kills == 1 and fig.stored_peak > 1000
    assert (fig.lost, fig.duplicates) == (0, 0)
