"""SIGTERM drains a real ``python -m conductor worker`` process: it stops pulling, finishes or
hands back its in-flight work within --drain-s, keeps its leases while it drains, and
deregisters; after a second worker finishes the rest, every item has exactly one result."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest

from conductor.embedded import free_port
from conductor.redis_contract import keys as K
from tests.conftest import ROOT, item
from tests.helpers import MK, quick

_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test():
    """A test that fails while its worker runs would leave it serving the next test's Redis."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def start_worker(url: str, name: str, log_path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "info", "worker", "--engine",
                                 "sim", "--model", "m", "--name", name, "--max-batch-size", "8", *extra],
                                env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log)
    _STARTED.append(proc)
    return proc


def events(log_path) -> list[dict]:
    with open(log_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def finish_with_second_worker(cdr, url: str, tmp_path, n: int) -> list[dict]:
    b = start_worker(url, "B", tmp_path / "b.log", "--idle-exit", "1.5")
    assert b.wait(60) == 0
    rows = [json.loads(r) for r in cdr.results("j")]
    ids = Counter(r["id"] for r in rows)
    assert set(ids.values()) == {1} and set(ids) == {f"i{k:03d}" for k in range(n)}  # exactly once each
    st = cdr.status("j")
    assert (st["completed"], st["pending"]) == (n, 0)
    return rows


def test_sigterm_with_a_short_drain_hands_back_what_did_not_finish(cdr, redis_url, tmp_path):
    quick(cdr)
    n = 64
    cdr.submit([item(f"i{k:03d}", 10, max_tokens=200) for k in range(n)], "j")
    port = free_port()
    a = start_worker(redis_url, "A", tmp_path / "a.log", "--sim-time-scale", "1", "--drain-s", "0.4",
                     "--metrics-port", str(port))
    # the sim runs 8 at once and A holds about one batch beyond (issue 37): two batches, one partly waiting
    wait_for(lambda: cdr.r.xpending(MK.batches, K.GROUP)["pending"] >= 2, what="A to claim work")
    time.sleep(0.2)
    # the metrics endpoint serves the worker's figures while it works
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    active = [float(line.split()[-1]) for line in body.splitlines()
              if line.startswith('conductor_worker_active_sequences{model="m",worker="A"}')]
    assert active and active[0] > 0
    claimed = cdr.r.xpending(MK.batches, K.GROUP)["pending"]
    t = time.monotonic()
    a.send_signal(signal.SIGTERM)
    assert a.wait(15) == 0
    took = time.monotonic() - t
    assert took < 0.4 + 3.0  # the drain time plus process exit, not the remaining work (>1 s)
    ev = events(tmp_path / "a.log")
    names = [e["event"] for e in ev]
    assert names.index("draining") < names.index("handed_back") < names.index("deregistered")
    handed = next(e for e in ev if e["event"] == "handed_back")
    assert handed["batches"] >= 1 and handed["requeued"] >= 1
    # nothing left under A: no pending entries, no consumer, no heartbeat, not registered
    assert cdr.r.xpending(MK.batches, K.GROUP)["pending"] == 0
    assert "A" not in [c["name"] for c in cdr.consumers("m")]
    assert not cdr.r.exists(MK.heartbeat("A")) and not cdr.r.hexists(MK.workers, "A")
    done_by_a = cdr.status("j")["completed"]
    assert 0 < done_by_a < n and claimed >= 1
    assert cdr.r.llen(MK.reclaimed) >= 1  # handed-back work waits in the reclaimed queue, served first
    rows = finish_with_second_worker(cdr, redis_url, tmp_path, n)
    by = Counter(r["worker"] for r in rows)
    assert by["A"] == done_by_a and by["B"] == n - done_by_a
    assert any(r["deliveries"] == 2 for r in rows if r["worker"] == "B")


def test_sigterm_with_time_to_drain_finishes_in_flight_work_and_keeps_its_leases(cdr, redis_url, tmp_path):
    quick(cdr)
    n = 48
    # outputs of 100..400 decode steps of ~6 ms: the first sixteen need over 2 s (371 steps)
    cdr.submit([item(f"i{k:03d}", 10, max_tokens=400) for k in range(n)], "j")
    a = start_worker(redis_url, "A", tmp_path / "a.log", "--sim-time-scale", "1", "--drain-s", "30",
                     "--high-water", "16", "--low-water", "4", "--heartbeat-ttl", "0.6")
    wait_for(lambda: cdr.r.xpending(MK.batches, K.GROUP)["pending"] >= 2, what="A to claim work")
    time.sleep(0.1)
    a.send_signal(signal.SIGTERM)
    # while it drains, its heartbeat (TTL 0.6 s) is renewed past the TTL
    time.sleep(1.0)
    assert a.poll() is None, "A finished draining too early for this test to mean anything"
    assert cdr.r.exists(MK.heartbeat("A"))
    assert a.wait(30) == 0
    ev = events(tmp_path / "a.log")
    assert any(e["event"] == "drained" for e in ev)
    assert not any(e["event"] == "handed_back" and e["batches"] for e in ev)
    assert cdr.r.xpending(MK.batches, K.GROUP)["pending"] == 0 and cdr.r.llen(MK.reclaimed) == 0
    done_by_a = cdr.status("j")["completed"]
    assert 0 < done_by_a < n  # it stopped pulling: the rest waited for B
    rows = finish_with_second_worker(cdr, redis_url, tmp_path, n)
    assert Counter(r["worker"] for r in rows)["A"] == done_by_a
    assert all(r["deliveries"] == 1 for r in rows)
