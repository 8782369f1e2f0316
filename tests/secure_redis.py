"""A private redis-server started with extra arguments (an ACL file, TLS), for tests/test_acl.py
and tests/test_tls.py; EmbeddedRedis pings without credentials, which these servers refuse."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from conductor.embedded import child_tie, find_server


class SecureRedis:
    def __init__(self, dir: Path, args: list[str], client: Callable[[], redis.Redis]) -> None:
        self.dir = dir
        self.args = args
        self.client = client
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> SecureRedis:
        log = self.dir / "redis.log"
        self.proc = subprocess.Popen([find_server(), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                                      "--logfile", str(log), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=child_tie())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server {' '.join(self.args)} exited at start: "
                                     f"{log.read_text(errors='replace')[-1500:] if log.exists() else ''}")
            try:
                c = self.client()
                c.ping()
                c.close()
                return self
            except (redis.ConnectionError, OSError):
                time.sleep(0.05)
        raise AssertionError(f"redis-server did not answer in {timeout}s: {log.read_text(errors='replace')[-1500:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
