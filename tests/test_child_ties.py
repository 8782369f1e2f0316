"""Nothing a command starts outlives it: an embedded redis-server (a benchmark's, a test's) and a benchmark's
worker processes get SIGTERM from the kernel when the process that started them dies, even by SIGKILL
(conductor/embedded.py child_tie). Before, only ``conductor run``'s server was tied: a benchmark killed by
``timeout`` or a test run cut off left its servers running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import redis

from conductor.embedded import EmbeddedRedis, child_tie
from tests.conftest import ROOT


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # a zombie: dead, its parent not yet reaping
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _sigkilled_parent_leaves(code: str) -> list[int]:
    """Run ``code`` in a child Python that prints the pids it started, one a line, then 'ready'; SIGKILL it;
    return those pids."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                         cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids: list[int] = []
    assert p.stdout is not None
    for line in p.stdout:
        if line.strip() == "ready":
            break
        pids.append(int(line))
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    p.stdout.close()
    return pids


def test_an_embedded_server_dies_with_the_process_that_started_it():
    pids = _sigkilled_parent_leaves("""
        from conductor.embedded import EmbeddedRedis
        srv = EmbeddedRedis().start()
        print(srv.proc.pid, flush=True)
        print("ready", flush=True)
        import time; time.sleep(60)
    """)
    assert len(pids) == 1 and _gone(pids[0]), "the embedded redis-server outlived its SIGKILLed parent"


def test_a_benchmarks_worker_process_dies_with_the_benchmark():
    pids = _sigkilled_parent_leaves("""
        import subprocess, sys
        from conductor.embedded import child_tie
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=child_tie())
        print(p.pid, flush=True)
        print("ready", flush=True)
        import time; time.sleep(60)
    """)
    assert len(pids) == 1 and _gone(pids[0])


def test_a_server_started_from_another_thread_is_not_tied_to_that_thread():
    # the kernel's tie is to the thread that started the child: a server a short-lived thread started
    # must not die when that thread ends
    out: list[EmbeddedRedis] = []
    t = threading.Thread(target=lambda: out.append(EmbeddedRedis().start()))
    t.start()
    t.join(30)
    assert child_tie() is not None  # this (main) thread would tie
    srv = out[0]
    try:
        time.sleep(0.5)
        assert srv.proc is not None and srv.proc.poll() is None
        assert redis.Redis.from_url(srv.url).ping()
    finally:
        srv.close()
