"""A worker's link to Redis through an outage: one log line when Redis goes away and one when it is
back, bounded probes with backoff in between, and redis-py's own retries cut short meanwhile.

The client (conductor/redis_contract/connection.py) retries a failed command 8 times with backoff, about 9 s
against a server that refuses connections. That rides out a blip, but a worker that sent every
call through it while Redis is down would log a line per call, stall its engine between calls,
and on SIGTERM wait for the server instead of stopping within its drain time. So once a call
fails for want of Redis (``Link.lost``), the worker stops calling it: its engine goes on, results
wait in the retry buffer, and ``Link.probe`` pings on a fresh connection of its own (no retries,
a short timeout) at intervals growing from 0.1 s to ``PROBE_CAP_S`` (0.5 s) until Redis answers; the
worker then joins it again (workers/worker.py ``_rejoin``: the server may have come back empty) and
calls ``Link.up``.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conductor.errors import RedisUnavailable
from conductor.redis_contract.connection import pool_for

log = logging.getLogger("conductor.worker")

# Redis unreachable, as opposed to answering with a refusal (workers/transient.py has both kinds).
# redis-py's BusyLoadingError (a server loading its data after a restart) is a ConnectionError.
# Not every OSError: a store file the disk tier cannot read is no outage.
_AWAY = (redis.ConnectionError, redis.TimeoutError, RedisUnavailable, ConnectionError, TimeoutError)


def is_away(e: BaseException) -> bool:
    return isinstance(e, _AWAY)


class StopRetry(Retry):
    """redis-py's retry policy, given up at once when ``give_up()`` holds (the worker is stopping,
    or already knows Redis is away): the failure is raised instead of waited out. A backoff sleep
    already begun still ends (at most the client's cap, 2 s)."""

    def __init__(self, inner: Retry, give_up: Callable[[], bool]) -> None:
        super().__init__(inner._backoff, inner._retries, tuple(inner._supported_errors))
        self._give_up = give_up

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def fail_or_give_up(error: Exception, *rest: Any) -> None:
            fail(error, *rest)
            if self._give_up():
                raise error

        return super().call_with_retry(do, fail_or_give_up, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> StopRetry:
        # every connection deep-copies the pool's policy: the copy must still ask the same worker
        return StopRetry(Retry(copy.deepcopy(self._backoff, memo), self._retries, tuple(self._supported_errors)),
                         self._give_up)


def cut_retries(r: Any, give_up: Callable[[], bool]) -> None:
    """Wrap the client's retry policy (its pool's connections, present and future) in StopRetry."""
    get, put = getattr(r, "get_retry", None), getattr(r, "set_retry", None)
    inner = get() if get is not None else None
    if isinstance(inner, Retry) and not isinstance(inner, StopRetry) and put is not None:
        put(StopRetry(inner, give_up))


# The longest wait between two probes: a worker is back within this of Redis answering again (issue 37:
# with 2 s, a 5 s outage cost up to 2 s more, and the fleet looked dead meanwhile). A probe is one
# connection attempt, refused at once by a host whose Redis is down: twice a second costs nothing.
PROBE_CAP_S = 0.5


class Link:
    """Whether one worker reaches Redis. ``lost`` and ``up`` say so once each per outage."""

    def __init__(self, r: Any, key: str, worker: str, model: str, *, first_s: float = 0.1, cap_s: float = PROBE_CAP_S,
                 probe_timeout_s: float = 1.0) -> None:
        self._pool = pool_for(r, key)  # the server that holds the model's keys
        self.worker, self.model = worker, model
        self.first_s, self.cap_s, self.probe_timeout_s = first_s, cap_s, probe_timeout_s
        self.down_since: float | None = None
        self.probes = 0
        self.error = ""
        self._wait = first_s
        self._next = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def lost(self, e: BaseException) -> bool:
        """True when ``e`` says Redis is away (the first time in an outage: one line, and probing
        starts); False for any other error, which the caller handles as before."""
        if not is_away(e):
            return False
        with self._lock:
            if self.down_since is None:
                now = time.monotonic()
                self.down_since, self.probes, self.error = now, 0, str(e)
                self._wait, self._next = self.first_s, now + self.first_s
                self._say("redis_down", error=self.error)
        return True

    def due_in(self) -> float:
        """Seconds until the next probe is due (0 when up)."""
        return max(0.0, self._next - time.monotonic()) if self.down else 0.0

    def probe(self, limit_s: float | None = None) -> bool:
        """When a probe is due: whether Redis answers a PING now, on a fresh connection without
        retries, within the probe timeout (or ``limit_s``, the caller's time left). A failed probe
        doubles the wait before the next, up to ``cap_s``."""
        if not self.down:
            return True
        if time.monotonic() < self._next:
            return False
        timeout = self.probe_timeout_s if limit_s is None else max(0.05, min(self.probe_timeout_s, limit_s))
        ok = self._ping(timeout)
        with self._lock:
            self.probes += 1
            if not ok:
                self._wait = min(self.cap_s, self._wait * 2)
                self._next = time.monotonic() + self._wait
        return ok

    def up(self, **fields: object) -> None:
        """Redis answers and the worker joined it again: one line, with how long it was away."""
        with self._lock:
            if self.down_since is None:
                return
            down_s = time.monotonic() - self.down_since
            self.down_since = None
            self._say("redis_back", down_s=round(down_s, 3), probes=self.probes, **fields)

    def _ping(self, timeout: float) -> bool:
        kw = dict(self._pool.connection_kwargs)
        kw.update(retry=Retry(NoBackoff(), 0), socket_connect_timeout=timeout, socket_timeout=timeout)
        conn = self._pool.connection_class(**kw)
        try:
            conn.connect()
            conn.send_command("PING")
            conn.read_response()
            return True
        except (redis.RedisError, OSError):
            return False
        finally:
            conn.disconnect()

    def _say(self, name: str, **fields: object) -> None:
        log.info(json.dumps({"event": name, "worker": self.worker, "model": self.model, **fields}, default=str))
