"""Issue 27: a command that did its work exits 0, every time, also beside a CPU load.

pyarrow's thread pools, started by ``pq.read_table``, made a command that read a store segment or a
Parquet file die by SIGABRT at interpreter exit once in a few runs on a busy machine ("terminate
called without an active exception"). The commands that touch the store and Parquet run here a
few dozen times beside two busy loops; before conductor/tier/parquet_bytes.py about one run in eight
ended by signal 6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conductor.client import Conductor
from conductor.tier.object_store import Store
from conductor.tier.result_segments import offload_model
from tests.conftest import ROOT, item
from tests.helpers import MK, contract, quick, results_for


@contextmanager
def cpu_load(n: int = 2) -> Iterator[None]:
    """``n`` busy loops (as `yes >/dev/null`) for the block's length, ended whatever happens."""
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _stored_job_and_results(redis_url: str, store: str) -> None:
    """Job "r" with its results moved to the store, job "w" waiting in store segments."""
    c = Conductor.from_url(redis_url, store=Store(store))
    c.ensure_model("m")
    quick(c, resident_tokens=0, results_window=20)
    c.submit([item(f"r{i}", 50) for i in range(100)], "r")
    while (b := c.claim(contract(size=32, tokens=100_000), "w")[0]) is not None:
        c.complete(b, results_for(b))
    offload_model(c, c.tier.store, "m")
    assert c.r.llen(MK.job_rsegs("r")) > 0
    quick(c, resident_tokens=200, results_window=20)
    c.submit([item(f"w{i}", 50, prefix=(f"s{i % 2}",)) for i in range(40)], "w")
    assert int(c.r.hget(MK.intake, "stored_items")) > 0


# Rounds of three commands: the default run's 4 would have caught the old SIGABRT (about one
# run in eight) four times in five; the long form's 8, nearly always.
@pytest.mark.parametrize("rounds", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_store_and_parquet_commands_exit_0_every_time_beside_a_load(redis_url, tmp_path, rounds):
    store = str(tmp_path / "store")
    _stored_job_and_results(redis_url, store)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": f"q{i}", "model": "m", "prefix": ["sys"], "prompt": f"q {i}",
                                          "input_tokens": 40, "max_tokens": 4} for i in range(30)]), src)
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url, PYTHONFAULTHANDLER="1")
    base = [sys.executable, "-m", "conductor", "--store", store]
    runs: list[tuple[list[str], int, bytes]] = []
    reports: list[bytes] = []  # a failing inspect's findings (on its stdout)
    with cpu_load():
        for k in range(rounds):
            cmds = [["inspect", "m", "--verify"], ["submit", "--create", str(src), "--job", f"p{k}"], ["results", "r"]]
            procs = [(cmd, subprocess.Popen(base + cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE)) for cmd in cmds]
            for cmd, p in procs:
                out, err = p.communicate(timeout=120)
                runs.append((cmd, p.returncode, err))
                if p.returncode != 0:  # the header, each row that differs and each ledger finding
                    reports.append(b"\n".join(x for x in out.splitlines() if b"differ" in x or b"ledger:" in x)[:3000])
                if cmd[0] == "results":
                    assert sorted(json.loads(x)["id"] for x in out.splitlines()) == sorted(f"r{i}" for i in range(100))
    bad = [(cmd, rc, err.decode()[-400:]) for cmd, rc, err in runs if rc != 0]
    assert not bad, f"{len(bad)} of {len(runs)} runs did not exit 0: {bad[:3]}; stdout: {reports[:2]}"
    assert not any(b"terminate called" in err or b"Fatal Python error" in err for _, _, err in runs)


def test_reading_and_writing_parquet_bytes_starts_no_thread():
    """The mechanism itself, deterministic: a segment and a results segment are encoded and
    decoded on the calling thread, so nothing of pyarrow's is left running at exit."""
    from conductor.formats.lines import parse_line
    from conductor.tier import result_segments as results_store
    from conductor.tier import segments

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    its = [parse_line(json.dumps({"id": f"t{i}", "model": "m", "prefix": ["sys"], "prompt": "p", "input_tokens": 5,
                                  "max_tokens": 2})) for i in range(10)]
    before = threads()
    seg = segments.decode(segments.encode(segments.build("m", "j", its)))
    rows = results_store.decode(results_store.encode("m", "j", ["1-0"], [b"t0"], [b"{}"]))
    assert len(seg.records) == 10 and rows == [("1-0", b"t0", b"{}")]
    assert threads() == before


def _listening(port: int) -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_long_lived_processes_exit_0_on_sigterm_beside_a_load(redis_url, tmp_path):
    """serve and the host agent (the worker and the exporter have their own tests) end with status 0
    on SIGTERM, started and stopped beside two busy loops."""
    from conductor.embedded import free_port
    c = Conductor.from_url(redis_url)
    c.ensure_model("m")
    port = free_port()
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url, PYTHONFAULTHANDLER="1")
    cmds = {
        "serve": ["serve", "--port", str(port), "--data-dir", str(tmp_path / "files")],
        "agent": ["agent", "--model", "m", "--gpus", "2", "--max-batch-size", "4", "--name", "ag"],
    }
    with cpu_load():
        for name, args in cmds.items():
            _start_and_terminate(name, args, env, tmp_path, port)


def _start_and_terminate(name: str, args: list[str], env: dict, tmp_path, port: int) -> None:
    import signal

    from tests.helpers import wait_for
    log = tmp_path / f"{name}.log"
    with log.open("wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "conductor", *args], cwd=str(ROOT), env=env,
                             stdout=subprocess.DEVNULL, stderr=err)

    def ready() -> bool:
        return _listening(port) if name == "serve" else "gpu_started" in log.read_text()
    try:
        wait_for(lambda: p.poll() is not None or ready(), timeout=60, what=f"{name} to start")
        assert p.poll() is None, f"{name} exited {p.returncode}: {log.read_text()[-1000:]}"
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, f"{name}: {log.read_text()[-1000:]}"
    finally:
        if p.poll() is None:
            p.kill()
