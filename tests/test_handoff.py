"""Same-host handoff (seed 001): the shared-memory ring, and the host agent with real GPU processes
(sim engines) on the test's Redis: every item once, a SIGKILLed GPU process's batch failed back and
run again, a SIGKILLed agent's batches reclaimed by another worker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from conductor.client import Conductor, connect
from conductor.redis_contract import keys as K
from conductor.workers.handoff_wire import Done, FrameReader, Hello, send
from conductor.workers.host_agent import HostAgent
from conductor.workers.shm_ring import KIND_BATCH, SHM_DIR, RingFull, RingReader, RingWriter
from conductor.workers.worker import WorkerOptions
from tests.conftest import ROOT
from tests.worker_kit import submit


def spec(time_scale: float = 0.0, size: int = 4) -> dict:
    return {"kind": "sim", "model": "m", "max_batch_size": size, "max_batch_tokens": 8192,
            "max_input_len": 4096, "time_scale": time_scale}


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def once_each(c: Conductor, ids: list[str], job: str = "j") -> list:
    rows = c.read_results(job)
    counts = Counter(r.id for r in rows)
    assert set(counts) == set(ids), f"missing {sorted(set(ids) - set(counts))[:5]}"
    assert max(counts.values()) == 1, f"duplicates: {[i for i, n in counts.items() if n > 1][:5]}"
    st = c.status(job)
    assert (st["completed"], st["failed"], st["pending"]) == (len(ids), 0, 0)
    return rows


# ---------------------------------------------------------------- the ring

def test_ring_records_wrap_by_offset_and_the_reader_map_is_read_only():
    w = RingWriter(4096)
    try:
        r = RingReader(w.name)
        with pytest.raises(TypeError):
            r.map[0:1] = b"x"  # mapped with ACCESS_READ: the consumer cannot write the ring
        sent = []
        for k in range(100):  # ~200-300 bytes each through a 4 KiB ring: it wraps several times
            body = json.dumps({"k": k, "pad": "x" * (150 + k)}).encode()
            try:
                w.write(KIND_BATCH, body)
            except RingFull:
                got = r.read()
                w.ack(r.pos)  # the position travels back over the socket in the agent
                assert [b for _, b in got] == sent
                sent = []
                w.write(KIND_BATCH, body)
            sent.append(body)
        assert [b for _, b in r.read()] == sent
        assert w.pos > 3 * w.capacity
        r.close()
    finally:
        w.close()


def test_ring_refuses_to_overwrite_what_the_reader_has_not_acknowledged():
    w = RingWriter(8192)
    try:
        for c in b"abcde":
            w.write(KIND_BATCH, bytes([c]) * 1500)
        with pytest.raises(RingFull):
            w.write(KIND_BATCH, b"f" * 1500)
        r = RingReader(w.name)
        assert [b[:1] for _, b in r.read()] == [b"a", b"b", b"c", b"d", b"e"]
        w.ack(r.pos)
        w.write(KIND_BATCH, b"f" * 1500)  # wraps to offset 0 behind a pad record
        assert [b[:1] for _, b in r.read()] == [b"f"]
        with pytest.raises(ValueError, match="quarter of the ring"):
            w.write(KIND_BATCH, b"g" * 2100)
        r.close()
    finally:
        w.close()


def test_frames_split_across_reads():
    fr = FrameReader()
    a, b = socket.socketpair()
    try:
        send(a, Done(key="m/1-0", results=[]))
        send(a, Done(key="m/2-0", results=[]))
        data = b.recv(1 << 16)
        got = fr.feed(data[:5]) + fr.feed(data[5:])
        assert [m.key for m in got if isinstance(m, Done)] == ["m/1-0", "m/2-0"]
        assert not any(isinstance(m, Hello) for m in got)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- the agent

def agent_thread(agent: HostAgent) -> threading.Thread:
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    return t


def test_agent_runs_a_job_through_its_gpu_processes_once_each(cdr, redis_url):
    ids = submit(cdr, 120)
    agent = HostAgent(Conductor(connect(redis_url)), spec(), 2, WorkerOptions(name="ag", idle_exit_s=0.5))
    rings = [g.ring.name for g in agent.gpus]
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in rings)  # unlinked once both ends mapped
    pids = [g.proc.pid for g in agent.gpus]
    agent_thread(agent).join(timeout=30)
    rows = once_each(cdr, ids)
    assert {r.worker for r in rows} <= {"ag/gpu0", "ag/gpu1"}
    assert agent.summary()["claim_to_engine_ms_p50"] is not None
    assert agent.batches_claimed == 30
    for pid in pids:  # the agent reaped its GPU processes
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert not cdr.r.hexists(agent.keys.workers, "ag")  # deregistered


def test_a_sigkilled_gpu_process_has_its_batch_failed_back_and_run_once(cdr, redis_url):
    ids = submit(cdr, 40, max_tokens=32)
    agent = HostAgent(Conductor(connect(redis_url)), spec(time_scale=1.0), 2,
                      WorkerOptions(name="ag", idle_exit_s=0.5), depth=1)
    t = agent_thread(agent)
    victim = agent.gpus[0]
    wait_for(lambda: victim.outstanding and agent.claim_to_engine_ms, what="a batch in GPU process 0's engine")
    held = {b.batch_id for b in victim.outstanding.values()}
    os.kill(victim.proc.pid, signal.SIGKILL)
    t.join(timeout=60)
    assert not t.is_alive()
    rows = once_each(cdr, ids)
    assert agent.gpu_deaths == 1
    again = {r.batch for r in rows if r.deliveries == 2}
    assert again and not again & held  # the failed-back items ran again, in a new batch


def test_a_sigkilled_agent_has_its_batches_reclaimed_and_every_item_runs_once(cdr, redis_url, tmp_path):
    ids = submit(cdr, 60, max_tokens=64)
    log = tmp_path / "agent.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as err:
        agent = subprocess.Popen([sys.executable, "-m", "conductor", "--redis", redis_url, "agent", "--model", "m",
                                  "--gpus", "2", "--max-batch-size", "4", "--sim-time-scale", "1.0",
                                  "--heartbeat-ttl", "1.0", "--name", "ag"], stderr=err, env=env)
    try:
        wait_for(lambda: cdr.status("j")["completed"] >= 4, what="the agent's first results")
        events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        gpu_pids = [e["pid"] for e in events if e["event"] == "gpu_started"]
        assert len(gpu_pids) == 2
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        held = cdr.r.xpending(K.ModelKeys("m").batches, K.GROUP)["pending"]
        assert held > 0  # it died holding batches
        wait_for(lambda: not any(_alive(p) for p in gpu_pids), timeout=10, what="the GPU processes to exit")
    finally:
        if agent.poll() is None:
            agent.kill()
    # the dead agent held the maintenance lease (3 s at this ttl): the worker idles past it
    done = subprocess.run([sys.executable, "-m", "conductor", "--redis", redis_url, "--log-level", "warning",
                           "worker", "--model", "m", "--max-batch-size", "4", "--idle-exit", "5",
                           "--heartbeat-ttl", "1.0", "--name", "w2"], env=env, timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = once_each(cdr, ids)
    assert any(r.deliveries == 2 and r.worker == "w2" for r in rows)  # reclaimed from the dead agent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (its parent, the agent, is dead and init has not reaped it yet) has exited too
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


def test_a_stopped_agent_finishes_or_hands_back_what_it_holds(cdr, redis_url):
    from tests.worker_kit import run_until_done, worker
    ids = submit(cdr, 40, max_tokens=32)
    agent = HostAgent(Conductor(connect(redis_url)), spec(time_scale=1.0), 2,
                      WorkerOptions(name="ag", drain_s=0.05))
    t = agent_thread(agent)
    wait_for(lambda: agent.claim_to_engine_ms, what="a batch in an engine")
    agent.request_stop()  # as SIGTERM does
    t.join(timeout=30)
    assert not t.is_alive()
    assert not cdr.r.xpending_range(agent.keys.batches, K.GROUP, "-", "+", 10, consumername="ag")
    assert cdr.status("j")["completed"] < len(ids)  # it stopped early: the rest went back, not lost
    run_until_done(worker(cdr, name="w2"))
    once_each(cdr, ids)


def test_an_agent_whose_completer_fails_hands_its_batches_back_and_raises(cdr, redis_url):
    from conductor.errors import ConductorError
    from tests.worker_kit import run_until_done, worker
    ids = submit(cdr, 40, max_tokens=32)
    agent = HostAgent(Conductor(connect(redis_url)), spec(time_scale=1.0), 2, WorkerOptions(name="ag"))

    def write_fails(batch, done) -> None:  # a write the agent cannot make (was: a result complete.lua refused)
        raise RuntimeError("refused")
    agent._write = write_fails
    failed: list[BaseException] = []

    def run() -> None:
        try:
            agent.run()
        except BaseException as e:  # noqa: BLE001
            failed.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    # before: the completer thread died, the heartbeat kept every batch leased and the agent waited forever
    t.join(timeout=30)
    assert not t.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], ConductorError) and "refused" in str(failed[0])
    assert not cdr.r.xpending_range(agent.keys.batches, K.GROUP, "-", "+", 10, consumername="ag")  # handed back
    assert not cdr.r.hexists(agent.keys.workers, "ag")
    run_until_done(worker(cdr, name="w2"))
    once_each(cdr, ids)


def test_agent_errors_are_one_line(redis_url):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "conductor", "--redis", redis_url, "--log-level", "warning", "agent", "--model", "m",
            "--create"]
    p = subprocess.run([*base, "--engine", "torch"], env=env, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr) == (2, "conductor: --model-path: required with --engine torch\n")
    # the engine cannot start in its GPU processes (TensorRT-LLM is not installed here)
    p = subprocess.run([*base, "--engine", "trtllm", "--model-path", "/nonexistent", "--gpus", "1"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.splitlines()[-1].startswith("conductor: agent: GPU process ")


def test_handoff_bench_quick_form_runs():
    p = subprocess.run([sys.executable, "bench/broker/handoff_bench.py", "--gpus", "2", "--items", "128",
                        "--batch", "8", "--time-scale", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith(("| direct", "| agent"))]
    assert len(rows) == 3
    assert all(float(r.split("|")[7]) > 0 for r in rows)  # a claim-to-engine median for each
