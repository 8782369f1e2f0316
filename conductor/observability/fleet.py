"""Which workers are alive, per model: registered in ``M:workers`` with a heartbeat key that has
not expired. Read by the follow/watch hint and the exporter's workers-alive gauge."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import IO

import redis

from conductor.redis_contract import keys as K


def live_workers(r: redis.Redis, model: str) -> list[str]:
    mk = K.ModelKeys(model)
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in r.hkeys(mk.workers))
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.exists(mk.heartbeat(n))
    return [n for n, alive in zip(names, pipe.execute(), strict=True) if alive]


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
