"""An idle worker blocks on the model's doorbell instead of polling claim.lua, and wakes on a submit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conductor.client import Conductor, connect
from conductor.client.fleet import live_workers
from tests.conftest import ROOT, item
from tests.helpers import MK, quick


def start_worker(url: str, name: str, model: str = "m") -> subprocess.Popen:
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    return subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                             "--model", model, "--name", name, "--max-batch-size", "8", "--max-batch-tokens", "8192",
                             "--max-input-len", "4096"], env=env, cwd=str(ROOT))


def wait_live(r, names: set[str], model: str = "m", timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while set(live_workers(r, model)) < names:
        assert time.monotonic() < deadline, "workers did not register"
        time.sleep(0.05)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        assert p.wait(30) == 0


def test_submit_and_seal_ring_the_bell_capped(cdr: Conductor):
    quick(cdr, budget_tokens=100, budget_items=4)
    cdr.submit([item(i, 10) for i in range(6)], "j")  # 60 tokens, 6 items: two full batches by items
    assert cdr.r.llen(MK.doorbell) == 2
    cdr.submit([item(f"b{i}", 10) for i in range(400)], "j")
    assert cdr.r.llen(MK.doorbell) == 16  # capped: unread rings cannot pile up
    cdr.r.delete(MK.doorbell)
    cdr.submit([item(i, 10) for i in range(6)], "j")  # all duplicates: nothing new, no ring
    assert cdr.r.llen(MK.doorbell) == 0
    cdr.seal("m")
    assert cdr.r.llen(MK.doorbell) == 1


def test_idle_workers_block_and_wake_on_a_submit(redis_url):
    """Two idle worker processes send a few commands a second, not the ~20 claims/s each of the
    old back-off to 50 ms (fails on the polling loop), and a submit is claimed within a bound far
    under the worker's 1 s timed wake (so the ring woke it, not the timer)."""
    r = connect(redis_url)
    c = Conductor(r)
    quick(c)
    procs = [start_worker(redis_url, f"w{i}") for i in range(2)]
    try:
        wait_live(r, {"w0", "w1"})
        time.sleep(1.5)  # past start-up: both blocked idle
        r.config_resetstat()
        t0 = time.monotonic()
        time.sleep(3.0)
        stats = r.info("commandstats")
        took = time.monotonic() - t0
        # Claims, lease renewals and heartbeats are all scripts: under one a second per idle worker now (none
        # at all in a window between two beats)
        # (plus the lease holder's sweep, its own timer), about 20 claims/s under the old polling.
        scripts_per_worker_s = stats.get("cmdstat_evalsha", {}).get("calls", 0) / took / 2
        assert scripts_per_worker_s <= 5, stats
        # Both wait in a BLPOP (a blocked client; its call is counted only when it returns, and a quiet
        # worker's block can outlast the window): looked at for up to a second, between two beats.
        deadline = time.monotonic() + 1.0
        while (blocked := sum(1 for cl in r.client_list()
                              if cl.get("cmd") == "blpop" and "b" in cl.get("flags", ""))) < 2:
            assert time.monotonic() < deadline, (blocked, r.client_list())
            time.sleep(0.05)
        lat = []
        for k in range(5):
            now_s, now_us = r.time()
            sent_ms = now_s * 1000 + now_us // 1000
            c.submit([item(f"x{k}", 10)], "j", seal=True)
            deadline = time.monotonic() + 10
            while not (rows := c.read_results("j")[k:]):
                assert time.monotonic() < deadline
                time.sleep(0.005)
            lat.append(rows[0].claimed_at - sent_ms)
            time.sleep(0.3)  # idle again
        lat.sort()
        assert lat[2] <= 150, lat  # generous; the figure itself is in bench/RESULTS.md
    finally:
        stop(procs)


def test_a_sigterm_ends_idle_workers_blocked_on_the_bell_at_once(redis_url):
    """systemd's stop of an idle worker: the SIGTERM cuts the BLPOP (workers/doorbell.py interrupt),
    where it used to wait out the block, up to 5 s (Python retries a read a signal interrupts).
    Four workers, at least three caught mid-block, each with up to 5 s of it left: every block ends
    within 2 s of the signal, as Redis sees its clients (0.07 to 0.1 s for the processes' exits here,
    4.1 s for the slowest before the interrupt); each exits 0, deregistered."""
    r = connect(redis_url)
    quick(Conductor(r))
    names = {f"w{i}" for i in range(4)}
    procs = [start_worker(redis_url, n) for n in sorted(names)]

    def blocked() -> set[str]:
        return {cl["id"] for cl in r.client_list() if cl.get("cmd") == "blpop" and "b" in cl.get("flags", "")}
    try:
        wait_live(r, names)
        deadline = time.monotonic() + 10
        while len(before := blocked()) < 3:  # past start-up: each blocked on the bell
            assert time.monotonic() < deadline, before
            time.sleep(0.05)
        for p in procs:
            p.terminate()
        t0 = time.monotonic()
        # The BLPOPs end at the signal, seen from Redis's side (a loaded machine may take its time
        # to end the processes themselves, not to cut the block): with the old wait, up to 5 s each.
        while left := before & blocked():
            assert time.monotonic() - t0 < 2.0, left
            time.sleep(0.02)
        took = []
        for p in procs:
            rc = p.wait(10)
            took.append(round(time.monotonic() - t0, 2))
            assert rc == 0, (rc, took)
        assert not set(live_workers(r, "m")) & names
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("reason", ["gate"])
def test_a_gated_worker_waits_quiet_ms_not_the_full_period(cdr: Conductor, reason):
    """After a claim that answered 'gate' the wait is bounded by quiet_ms (the moment the gate may
    open without a ring), not by the 1 s maintenance period."""
    from conductor.workers.doorbell import Doorbell
    quick(cdr, quiet_ms=100)
    bell = Doorbell(cdr, "m")
    t = time.monotonic()
    assert bell.wait(1.0, reason) is False
    assert 0.08 <= time.monotonic() - t < 0.5
    t = time.monotonic()
    assert bell.wait(0.3, "idle") is False
    assert time.monotonic() - t >= 0.25
    cdr.r.lpush(MK.doorbell, 1)
    t = time.monotonic()
    assert bell.wait(1.0, "idle") is True and time.monotonic() - t < 0.1


def _answers(w) -> list[str]:
    """The answers of the worker's claims from now on (the real claim, each answer noted)."""
    answers: list[str] = []
    claim = w.shards.claim

    def counted(contract, consumer):
        got = claim(contract, consumer)
        answers.append(got[1])
        return got
    w.shards.claim = counted
    return answers


def test_a_busy_worker_that_found_nothing_claims_again_on_a_ring_not_every_step(cdr: Conductor):
    """A job's tail: the engine runs the last batch and a claim answered 'idle'. The worker used to claim
    after every engine step (about 60 empty claims a second on this sim, 1,204 in a 16-worker job of
    8,000 items); now it claims again on a ring it takes off the doorbell (workers/pacing.py BusyIdle),
    so a submit meanwhile is still claimed while the engine runs, and the ring is passed on."""
    from tests.worker_kit import sim, submit, worker
    submit(cdr, 4, max_tokens=400)  # one batch: the sim runs it 0.6 to 2.4 s at time scale 1
    w = worker(cdr, sim(time_scale=1.0))
    answers = _answers(w)
    while "idle" not in answers:
        w.turn()
    assert w.batches_claimed == 1 and w.engine.active()
    cdr.r.delete(MK.doorbell)  # the first submit's ring, which no idle worker took (it lets one claim by)
    before, turns, t0 = len(answers), 0, time.monotonic()
    while time.monotonic() - t0 < 0.4 and w.engine.active():
        w.turn()
        turns += 1
    assert turns >= 10 and len(answers) == before, (turns, answers)  # no claim while only the engine changed
    submit(cdr, 4, max_tokens=400, start=4)  # rings once: a full batch
    t0 = time.monotonic()
    while w.batches_claimed < 2:
        assert time.monotonic() - t0 < 0.5, answers
        w.turn()
    assert w.engine.active() > 0 and w.busy_idle.skipped >= 10
    assert cdr.r.llen(MK.doorbell) == 1  # passed on: an idle worker wakes, in case more is left


def test_a_busy_worker_told_to_wait_claims_again_after_the_quiet_time_not_every_step(cdr: Conductor):
    """A claim that answered 'wait' (here: the active shape holds less than a full batch and intake is not
    quiet yet) while the engine runs: the worker used to claim again after every engine step, each a
    full claim pass (39 in a 16-worker job of 8,000 items, about 0.8M instructions each); now it claims
    again on a ring, its engine's end, or once the model's quiet time has passed (workers/pacing.py
    BusyIdle), when the held-back items may go: that claim drains them."""
    from tests.worker_kit import sim, submit, worker
    submit(cdr, 6, max_tokens=1000)  # a batch of 4 runs 1.5 to 6 s on the sim at time scale 1; 2 are left
    quick(cdr, quiet_ms=1000, drain_batches=0)  # the 2 left wait for a full batch or quiet intake
    w = worker(cdr, sim(time_scale=1.0))
    answers = _answers(w)
    while "wait" not in answers:
        w.turn()
    t_wait = time.monotonic()
    assert w.batches_claimed == 1 and w.engine.active()
    cdr.r.delete(MK.doorbell)  # the submit's ring, which no idle worker took (it lets one claim by)
    before, turns = len(answers), 0
    while time.monotonic() - t_wait < 0.5 and w.engine.active():
        w.turn()
        turns += 1
    assert turns >= 10 and len(answers) == before, (turns, answers)  # no claim while only the engine changed
    while w.batches_claimed < 2:
        assert time.monotonic() - t_wait < 2.0, answers
        w.turn()
    assert time.monotonic() - t_wait >= 0.9  # the quiet time (the intake's 1 s began before the 'wait')
    assert len(answers) == before + 1 and w.busy_idle.skipped >= 10  # one claim, and it took the 2 left
