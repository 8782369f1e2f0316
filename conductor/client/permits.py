"""The request path's in-flight limit: a fixed number of permits, each with a safety deadline.

A permit is taken before a request is sent and given back on every way out (completion,
timeout, rejection, close, cancel). Should a path ever miss its give-back, the permit's
deadline (the request's timeout plus a margin) returns it the next time anyone looks, so the
limit cannot leak. Giving back is idempotent: the safety return and a late give-back never
count twice.
"""

from __future__ import annotations

import itertools
import threading
import time


class Permits:
    """Thread-safe counting of permits; waiting for one is the caller's (sync or asyncio)."""

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_in_flight: must be a whole number >= 1, got {n!r}")
        self.n = n
        self._out: dict[int, float] = {}  # permit -> safety deadline (monotonic)
        self._ids = itertools.count()
        self.lock = threading.Lock()
        self.freed = threading.Condition(self.lock)
        self.reaped = 0  # permits the safety deadline returned (a missed give-back)
        self.closed = False  # set by the client's close(): waiters for a permit give up

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.freed.notify_all()

    def _reap(self, now: float) -> None:
        late = [p for p, dl in self._out.items() if dl <= now]
        for p in late:
            del self._out[p]
        if late:
            self.reaped += len(late)
            self.freed.notify(len(late))

    def try_take(self, hold_s: float) -> int | None:
        """A permit held for at most ``hold_s`` seconds, or None when all are out."""
        with self.lock:
            now = time.monotonic()
            self._reap(now)
            if len(self._out) >= self.n:
                return None
            p = next(self._ids)
            self._out[p] = now + hold_s
            return p

    def next_deadline(self) -> float | None:
        with self.lock:
            return min(self._out.values(), default=None)

    def give(self, permit: int) -> bool:
        """Give a permit back; False when it was back already (idempotent)."""
        with self.lock:
            if self._out.pop(permit, None) is None:
                return False
            self.freed.notify()
            return True

    def take(self, hold_s: float, wait_s: float) -> int | None:
        """Block up to ``wait_s`` for a permit (threads); None when none came back in time, or
        the permits were closed."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            while not self.closed:
                now = time.monotonic()
                self._reap(now)
                if len(self._out) < self.n:
                    p = next(self._ids)
                    self._out[p] = now + hold_s
                    return p
                if now >= deadline:
                    return None
                # wake at a safety deadline too: a leaked permit comes back then
                soonest = min(self._out.values())
                self.freed.wait(max(0.0, min(deadline, soonest) - now))
            return None

    @property
    def in_flight(self) -> int:
        with self.lock:
            self._reap(time.monotonic())
            return len(self._out)

    @property
    def available(self) -> int:
        return self.n - self.in_flight
