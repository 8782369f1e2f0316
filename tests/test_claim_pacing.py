"""Claims follow the engine (issue 37): a sim worker holds about one batch beyond what its engine runs,
so a cancel, a priority or a tenant's fair share still acts on the backlog, which waits in Redis.

Through the real CLI and real worker processes on a real Redis, with a real time scale. The bounds are
structural (what the worker may hold), never timings: a slow machine only makes fewer items finish.

What a sim worker may hold: the engine runs ``--max-batch-size`` (B) sequences at once, asks for another
batch only while fewer than B/2 wait to start, and a batch is written when its last item finishes
(outputs of one batch are 1/4 to all of max_tokens long). So at any moment it holds the batches with
items running (one or two: the last items of the older batch run beside the next one's) and the one
waiting: two or three batches, four at the odd moment, where a worker that claims ahead held tens
(43 in the issue, 3 s into the job; 1,267 of 3,000 items then ran after a cancel)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from conductor.redis_contract import keys as K
from tests.conftest import ROOT, cli
from tests.helpers import MK

B = 16  # --max-batch-size: the sim engine runs this many sequences at once


HELD = 4  # batches a worker may hold at once (the module's docstring)


def write_input(path, n: int, max_tokens: int = 64) -> None:
    """One shape of ``n`` items. Prompts of about 100 tokens: a second worker joins a shape only while it
    holds a batch's tokens beyond one per worker (lua/lib_lifecycle.lua), which short prompts never do."""
    words = "word " * 100
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            f.write(json.dumps({"id": f"i{k:04d}", "model": "m", "prompt": f"prompt {k} {words}",
                                "max_tokens": max_tokens}) + "\n")


def start_worker(url: str, name: str, log_path) -> subprocess.Popen:
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "conductor", "worker", "--engine", "sim", "--model", "m",
                                 "--name", name, "--max-batch-size", str(B), "--sim-time-scale", "1"],
                                env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log)


def pending_by_worker(r) -> dict[str, int]:
    """Batches each consumer holds (XPENDING's summary); {} before the group exists."""
    try:
        summary = r.xpending(MK.batches, K.GROUP)
    except Exception:  # noqa: BLE001 - NOGROUP: no worker has joined yet
        return {}
    return {(c["name"].decode() if isinstance(c["name"], bytes) else c["name"]): int(c["pending"])
            for c in summary.get("consumers") or []}


def status(url: str, job: str) -> dict:
    return json.loads(cli("status", job, "--json", url=url).stdout)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            assert p.wait(60) == 0
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise


def wait_for_claims(cdr, workers: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(pending_by_worker(cdr.r)) >= workers:
            return
        time.sleep(0.05)
    raise AssertionError(f"{workers} workers did not claim within {timeout:.0f} s")


def test_a_worker_holds_about_one_batch_beyond_what_its_engine_runs(cdr, redis_url, tmp_path):
    n = 3000
    write_input(tmp_path / "in.jsonl", n)
    cli("submit", "--create", str(tmp_path / "in.jsonl"), "--job", "j", url=redis_url)
    w = start_worker(redis_url, "w1", tmp_path / "w1.log")
    try:
        wait_for_claims(cdr, 1)
        held, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 3.0:
            held.append(pending_by_worker(cdr.r).get("w1", 0))
            time.sleep(0.05)
        st = status(redis_url, "j")
        # the backlog still waits in Redis (a worker claiming ahead had taken it by now)
        assert st["request_counts"]["completed"] + HELD * B < n
        assert len(held) >= 10
        assert max(held) <= HELD and statistics.median(held) <= 3, held
    finally:
        stop([w])


def test_a_cancel_3s_into_a_job_leaves_about_a_batch_a_worker_to_run(cdr, redis_url, tmp_path):
    n, workers = 3000, 2
    write_input(tmp_path / "in.jsonl", n)
    cli("submit", "--create", str(tmp_path / "in.jsonl"), "--job", "j", url=redis_url)
    procs = [start_worker(redis_url, f"w{i}", tmp_path / f"w{i}.log") for i in range(workers)]
    try:
        wait_for_claims(cdr, workers)
        time.sleep(3.0)
        d = json.loads(cli("cancel", "j", "--json", url=redis_url).stdout)
        done_at_cancel, in_flight = d["request_counts"]["completed"], d["pending"]
        # what the workers held when the cancel came: the only items it lets run
        assert in_flight <= workers * HELD * B, d
        deadline = time.monotonic() + 120
        while (st := status(redis_url, "j"))["pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert st["status"] == "cancelled" and st["pending"] == 0, st
        rc = st["request_counts"]
        assert rc["completed"] + rc["failed"] == n
        answered_after = rc["completed"] - done_at_cancel
        assert answered_after <= in_flight <= workers * HELD * B, (answered_after, in_flight, st)
        assert rc["failed"] >= n - done_at_cancel - workers * HELD * B  # the rest was cancelled, never run
    finally:
        stop(procs)
