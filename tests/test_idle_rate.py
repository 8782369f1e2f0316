"""An idle worker costs Redis one lua/idle_beat.lua call and one doorbell BLPOP a beat (issue 36:
at most 1 command a second), wakes on a ring, finds work that comes without one at its next beat,
and the maintenance lease passes on when its holder dies. The figures are bench/RESULTS.md's
(bench/broker/idle_fleet.py --idle-goal); these tests count, with wide margins."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from bench.common import sent
from conductor.client import Conductor, connect
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.workers.engines.sim import SimEngine
from conductor.workers.worker import Worker, WorkerOptions
from tests.conftest import ROOT, item
from tests.helpers import MK, contract, quick
from tests.worker_kit import stop_fleet


def beat(c: Conductor, worker: str = "w", busy: int | None = 5, lease_ms: int = 5000) -> calls.IdleBeat:
    return calls.idle_beat(MK, worker, int(time.time() * 1000), 10_000, lease_ms, busy).run(c.scripts)


def test_idle_beat_heartbeat_lease_and_waiting_work(cdr: Conductor):
    quick(cdr)
    cdr.r.hset(MK.workers, "w", "{}")
    got = beat(cdr)
    assert got == calls.IdleBeat(held=True, waits=False, registered=True)
    assert 9_000 < cdr.r.pttl(MK.heartbeat("w")) <= 10_000
    assert cdr.r.get(MK.maint_lease) == b"w" and cdr.r.hget(MK.busy, "w") == b"5"
    # another worker neither takes the lease nor renews it; an empty busy leaves the hash alone
    cdr.r.pexpire(MK.maint_lease, 1000)
    other = beat(cdr, "x", busy=None)
    assert not other.held and not other.registered and cdr.r.hget(MK.busy, "x") is None
    assert cdr.r.pttl(MK.maint_lease) <= 1000
    assert beat(cdr).held and cdr.r.pttl(MK.maint_lease) > 4000  # renewed by its holder
    cdr.r.delete(MK.maint_lease)
    assert beat(cdr, "x").held  # a lapsed lease goes to whoever beats first
    # work waits: items in lanes, then none once claimed, then reclaimed work
    cdr.submit([item(0, 10)], "j")
    assert beat(cdr, "x").waits
    cdr.pause("m")
    assert not beat(cdr, "x").waits  # a claim would answer 'paused'
    cdr.resume("m")
    b, _ = cdr.claim(contract(8, max_input_len=4096), "gone")
    assert b is not None and not beat(cdr, "x").waits
    # asked, the holder is told the batches in flight (its sweep's XPENDING), another worker is not
    told = calls.idle_beat(MK, "x", int(time.time() * 1000), 10_000, 5000, None, in_flight=True).run(cdr.scripts)
    assert told.held and told.in_flight == 1
    assert calls.idle_beat(MK, "w", int(time.time() * 1000), 10_000, 5000, None, in_flight=True).run(
        cdr.scripts).in_flight == -1
    cdr.reclaim_consumer("m", "gone", force=True)
    assert beat(cdr, "x").waits


def test_the_holders_beat_is_told_which_idle_workers_lapsed(cdr: Conductor):
    """A sharded model's own keys (``holding``): each idle beat indexes when its heartbeat runs out
    (M:beats); the holder's is told the workers whose entry ran out and whose heartbeat is gone, once,
    and drops every entry that ran out (a live one's next beat puts it back); another worker is told
    nothing."""
    quick(cdr)

    def idle(worker: str, ttl_ms: int = 10_000) -> calls.IdleBeat:
        return calls.idle_beat(MK, worker, int(time.time() * 1000), ttl_ms, 5000, None, in_flight=True,
                               holding=True).run(cdr.scripts)

    assert idle("x").held and idle("x").lapsed == ()
    assert not idle("w", ttl_ms=50).held
    cdr.r.set(MK.heartbeat("y"), 1)  # alive, its entry run out (a heartbeat thread beat it since)
    cdr.r.zadd(MK.beats, {"y": 1})
    assert idle("w", ttl_ms=50).lapsed == ()  # not the holder: not told
    time.sleep(0.1)
    assert idle("x").lapsed == ("w",)
    assert cdr.r.zrange(MK.beats, 0, -1) == [b"x"] and idle("x").lapsed == ()


def _fleet(url: str, n: int) -> tuple[list[Worker], list[threading.Thread]]:
    workers = [Worker(Conductor(connect(url)), SimEngine("m", max_batch_size=8, max_batch_tokens=8192),
                      WorkerOptions(name=f"i{i}")) for i in range(n)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    return workers, threads


@pytest.fixture
def fleet(redis_url: str) -> Iterator[list[Worker]]:
    r = connect(redis_url)
    quick(Conductor(r))
    workers, threads = _fleet(redis_url, 4)
    yield workers
    stop_fleet(workers, threads)
    r.close()


def test_idle_workers_send_under_one_command_a_second(redis_url, fleet):
    """Counted on each worker's own connections: a non-holder sends one beat and one BLPOP every
    5 s (0.4 a second) at the default 10 s TTL, not the ~4.8 a second of a timed claim, a lease call
    and a heartbeat; INFO commandstats agrees (few script calls, no claim's LRANGE)."""
    r = connect(redis_url)
    deadline = time.monotonic() + 30
    while r.hlen(MK.workers) < 4 or not all(w.last_claim == "idle" for w in fleet):
        assert time.monotonic() < deadline, "the fleet did not go idle"
        time.sleep(0.1)
    for w in fleet:  # consumers of the group, as a worker is once it has claimed: the sweep visits each
        r.xgroup_createconsumer(MK.batches, K.GROUP, w.name)
    time.sleep(3.5)  # each through its first beat
    sent.install()
    try:
        sent.reset()
        r.config_resetstat()
        t0 = time.monotonic()
        time.sleep(9.5)
        took = time.monotonic() - t0
        stats = r.info("commandstats")
        holder = (r.get(MK.maint_lease) or b"").decode()
        per = {w.name: sent.of(w.c.r) / took for w in fleet}
    finally:
        sent.uninstall()
    assert holder in per, per
    others = [v for k, v in per.items() if k != holder]
    assert all(0.1 < v <= 1.0 for v in others), per
    assert per[holder] <= 20, per  # its sweep every second (measured: about 8)
    assert stats.get("cmdstat_lrange", {}).get("calls", 0) == 0, stats  # no claim (claim.lua + LRANGE)
    assert stats["cmdstat_evalsha"]["calls"] / took <= 3 * 0.5 + 6, stats
    for w in fleet:
        assert r.pttl(MK.heartbeat(w.name)) > 0


def test_the_idle_lease_holder_sends_under_one_command_a_second(redis_url, monkeypatch):
    """Nothing in flight, no intake task, no deadline: the maintenance lease holder sweeps with every
    second beat (its lease and the pending count from the beat, the deadlines and the intake tasks
    read: two commands), not every second; it keeps its lease with its beats alone (it was about 5
    commands a second: a lease call, an XPENDING, the two reads and a BLPOP each second)."""
    from conductor.workers import maintenance
    monkeypatch.setattr(maintenance, "FULL_SWEEP_S", 3.0)  # its first full sweep sooner (10 s by default)
    r = connect(redis_url)
    quick(Conductor(r))
    workers, threads = _fleet(redis_url, 2)
    try:
        deadline = time.monotonic() + 30
        while r.hlen(MK.workers) < 2 or not all(w.last_claim == "idle" for w in workers):
            assert time.monotonic() < deadline, "the fleet did not go idle"
            time.sleep(0.1)
        time.sleep(4.0)  # past the first full sweep (3 s after the first), which a quiet part runs once
        holder = (r.get(MK.maint_lease) or b"").decode()
        per = sent.rates({w.name: w.c.r for w in workers}, 10.5)  # a quiet sweep (every second beat) at least
        assert (r.get(MK.maint_lease) or b"").decode() == holder and holder in per, (holder, per)
        assert per[holder] <= 1.0, per  # 0.6: a beat and a BLPOP each 5 s, two reads each 10 s
        assert all(0.1 < v <= 0.5 for k, v in per.items() if k != holder), per
    finally:
        stop_fleet(workers, threads)
        r.close()


def test_an_idle_worker_wakes_on_a_ring_and_finds_work_without_one(cdr: Conductor, fleet):
    deadline = time.monotonic() + 30
    while not all(w.last_claim == "idle" for w in fleet):
        assert time.monotonic() < deadline, "the fleet did not go idle"
        time.sleep(0.1)
    time.sleep(0.5)
    s, us = cdr.r.time()
    cdr.submit([item("rung", 10)], "j", seal=True)  # seal.lua rings
    while not (rows := cdr.read_results("j")):
        assert time.monotonic() < deadline + 30
        time.sleep(0.01)
    # far under the 5 s beat: the ring woke it, not the beat (the figure: bench/RESULTS.md)
    assert rows[0].claimed_at - (s * 1000 + us / 1000) < 2000
    time.sleep(0.5)
    cdr.r.delete(MK.doorbell)
    cdr.submit([item("quiet", 10)], "k")  # one item, no seal: no ring; quiet intake opens it
    assert cdr.r.llen(MK.doorbell) == 0
    deadline = time.monotonic() + 30
    while not cdr.read_results("k"):
        assert time.monotonic() < deadline, "work that came without a ring was not found by a beat"
        time.sleep(0.05)


def _worker(url: str, name: str) -> subprocess.Popen:
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    return subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                             "--model", "m", "--name", name, "--max-batch-size", "8", "--max-batch-tokens", "8192",
                             "--max-input-len", "4096", "--heartbeat-ttl", "3"], env=env, cwd=str(ROOT))


def test_the_lease_passes_on_when_its_idle_holder_is_killed_and_dead_work_comes_back(redis_url):
    r = connect(redis_url)
    c = Conductor(r)
    quick(c)
    # A batch held by "ghost", alive while the test renews its heartbeat: it dies once the lease
    # has passed on, and the new holder's sweep must put its batch back.
    c.submit([item(i, 10) for i in range(3)], "j", seal=True)
    b, _ = c.claim(contract(8, max_input_len=4096), "ghost")
    assert b is not None and len(b.items) == 3
    r.set(MK.heartbeat("ghost"), 1, px=120_000)
    r.delete(MK.doorbell)
    procs = {n: _worker(redis_url, n) for n in ("a", "b")}
    try:
        deadline = time.monotonic() + 30
        while not (holder := (r.get(MK.maint_lease) or b"").decode()) or r.hlen(MK.workers) < 2:
            assert time.monotonic() < deadline, "no lease holder"
            time.sleep(0.1)
        time.sleep(1.0)  # both idle
        procs[holder].send_signal(signal.SIGKILL)
        procs[holder].wait(10)
        other = "b" if holder == "a" else "a"
        deadline = time.monotonic() + 60
        while r.get(MK.maint_lease) != other.encode():
            assert time.monotonic() < deadline, "the lease did not pass on"
            time.sleep(0.1)
        assert not c.read_results("j")
        r.delete(MK.heartbeat("ghost"))
        deadline = time.monotonic() + 90
        while len(c.read_results("j")) < 3:
            assert time.monotonic() < deadline, "the dead consumer's batch did not come back"
            time.sleep(0.1)
        assert {res.worker for res in c.read_results("j")} == {other}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            p.wait(30)
