"""The hint a follow or a watch gives when nothing serves one of a job's models (``conductor
results --follow``, ``conductor status --watch``): it would otherwise wait in silence."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import IO

import redis

from conductor.client.fleet import live_workers


class NoWorkerHint:
    """Says once per model, on stderr, when nothing serves one of a job's models: a follow or
    watch would otherwise wait in silence. Looks again every ``every_s`` seconds."""

    def __init__(self, r: redis.Redis, models: Iterable[str], stream: IO[str] = sys.stderr,
                 every_s: float = 10.0) -> None:
        self.r = r
        self.models = list(models)
        self.stream = stream
        self.every_s = every_s
        self.said: set[str] = set()
        self._next = 0.0

    def check(self, models: Iterable[str] | None = None) -> list[str]:
        """The models newly found without a live worker (and says so); at most every ``every_s``."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self.every_s
        if models is not None:
            self.models = list(models)
        new = [m for m in self.models if m not in self.said and not live_workers(self.r, m)]
        for m in new:
            self.said.add(m)
            self.stream.write(f"conductor: hint: no live worker serves model {m}; its items wait until one runs "
                              f"(conductor worker --model {m} ...)\n")
        self.stream.flush()
        return new
