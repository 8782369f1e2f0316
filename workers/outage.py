"""A worker's link to Redis through an outage: one log line when Redis goes away and one when it is
back, bounded probes with backoff in between, and redis-py's own retries cut short meanwhile.

The client (conductor/redis_contract/connection.py) retries a failed command 8 times with backoff, about 9 s
against a server that refuses connections. That rides out a blip, but a worker that sent every
call through it while Redis is down would log a line per call, stall its engine between calls,
and on SIGTERM wait for the server instead of stopping within its drain time. So once a call
fails for want of Redis (``Link.lost``), the worker stops calling it: its engine goes on, results
wait in the retry buffer, and ``Link.probe`` pings on a fresh connection of its own (no retries,
a short timeout) at intervals growing from 0.1 s to ``PROBE_CAP_S`` (0.5 s) until Redis answers; the
worker then joins it again (``OutageHandling._rejoin`` below: the server may have come back empty) and
calls ``Link.up``. ``OutageHandling`` is the worker's side of it: the steps it takes while Redis is away,
its rejoining, and what it leaves pending when it stops meanwhile.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conductor.client import Conductor
from conductor.errors import RedisUnavailable
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str, pool_for
from conductor.redis_contract.records import Batch, Contract, Result

from .engines.base import Engine
from .held import InFlight, event
from .transient import RIDE_OUT, is_transient

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
        self._r, self._key = r, key
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
        if isinstance(self._r, redis.RedisCluster):
            # On a Redis Cluster the node that holds the keys changes when a replica takes over from
            # a dead primary: each probe asks the cluster client, whose map a failed probe refreshes.
            self._pool = pool_for(self._r, self._key)  # type: ignore[arg-type]  # pool_for takes either
        ok = self._ping_pool(timeout)
        if not ok and isinstance(self._r, redis.RedisCluster):
            try:
                self._r.nodes_manager.initialize()
            except (redis.RedisError, OSError):
                pass  # no node answered: the next probe asks again
        return ok

    def _ping_pool(self, timeout: float) -> bool:
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


class OutageHandling:
    """The worker's side of an outage (workers/worker.py's ``Worker`` mixes this in): while Redis is away
    its engine goes on and results wait; once a probe answers, it joins Redis again; stopping with
    Redis away leaves its batches pending under its name, said in one line."""

    # the worker's state (workers/worker_start.py WorkerStart)
    c: Conductor
    engine: Engine
    name: str
    contract: Contract
    keys: K.ModelKeys
    link: Link
    inflight: dict[str, InFlight]
    retry: deque[tuple[Batch, list[Result], bool]]
    stopping: threading.Event
    _rejoin_needed: threading.Event
    _lock: threading.Lock

    def _step(self) -> None:  # workers/worker.py
        raise NotImplementedError

    def _account(self) -> None:  # workers/worker.py
        raise NotImplementedError

    def register(self, say: bool = True) -> None:  # workers/worker_start.py
        raise NotImplementedError

    def _beat(self) -> None:  # workers/worker_start.py
        raise NotImplementedError

    def _ride_out(self, limit_s: float | None = None) -> bool:
        """One step while Redis is away: running sequences go on (their results wait in the retry
        buffer), a probe goes out when due, and once Redis answers the worker joins it again.
        True when it is back. Sleeps until the next probe when the engine has nothing to run."""
        if self.engine.active():
            self._step()
        if self._reconnect(limit_s):
            return True
        if not self.engine.active():
            wait = max(0.005, self.link.due_in() if limit_s is None else min(self.link.due_in(), limit_s))
            if self.stopping.is_set():
                time.sleep(wait)  # draining: the drain's deadline bounds it
            else:
                self.stopping.wait(wait)  # a SIGTERM ends the wait
        self._account()
        return False

    def _reconnect(self, limit_s: float | None = None) -> bool:
        if self.link.down and not self.link.probe(limit_s):
            return False
        try:
            dropped = self._rejoin()
        except RIDE_OUT as e:
            if not is_transient(e):
                raise
            self.link.lost(e)
            event("rejoin_failed", worker=self.name, error=str(e))
            return False
        self._rejoin_needed.clear()
        self.link.up(**dropped)
        return True

    def _rejoin(self) -> dict[str, int]:
        """Join Redis again after an outage or a NOGROUP. It may have come back without this
        worker's keys (a new server on the same address, or a FLUSHALL): the group and the
        registration are made again. A batch of this worker's that is no longer pending under its
        name was lost with the data, or reclaimed while the heartbeat lapsed: its results could not
        be taken (complete.lua refuses them), so it is dropped here instead of failing every write."""
        pipe = self.c.r.pipeline(transaction=False)
        pipe.hexists(self.keys.workers, self.name)
        pipe.xpending_range(self.keys.batches, K.GROUP, "-", "+", 10_000, consumername=self.name)
        registered, pending = pipe.execute(raise_on_error=False)
        if isinstance(registered, Exception):
            raise registered
        lost_group = isinstance(pending, redis.ResponseError) and "NOGROUP" in str(pending)
        if isinstance(pending, Exception) and not lost_group:
            raise pending
        own = self.contract.model
        mine = set() if lost_group else {f"{own}/{as_str(p['message_id'])}" for p in pending}
        mine |= self._pending_on_shards()
        with self._lock:
            gone = {e.batch.key: e.batch for e in self.inflight.values() if e.batch.key not in mine}
            gone.update((b.key, b) for b, _, _ in self.retry if b.key not in mine)
            for key in gone:
                self.inflight.pop(key, None)
            self.retry = deque(r for r in self.retry if r[0].key not in gone)
        if lost_group or not registered:
            self.c.ensure_model(self.contract.model, force=True)
            self.register(say=False)
        else:
            self._beat()  # the lease of what is still pending, renewed before it lapses
        out = {"rejoined": int(lost_group or not registered)}
        if gone:
            out.update(dropped_batches=len(gone), dropped_items=sum(len(b.items) for b in gone.values()))
        return out

    def _pending_on_shards(self) -> set[str]:
        """Batch.key of each batch this worker holds on another shard of its model that is still pending
        under its name there: the model's own pending list says nothing of a shard's (a shard whose
        group is gone holds none of them)."""
        with self._lock:
            shards = {e.batch.model for e in self.inflight.values()} | {b.model for b, _, _ in self.retry}
        shards.discard(self.contract.model)
        keys: set[str] = set()
        for name in sorted(shards):
            try:
                pending = self.c.r.xpending_range(K.ModelKeys(name).batches, K.GROUP, "-", "+", 10_000,
                                                  consumername=self.name)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                continue
            keys |= {f"{name}/{as_str(p['message_id'])}" for p in pending}
        return keys

    def _leave_pending(self) -> None:
        """Stopping with Redis away: nothing more can be written. The batches stay pending under
        this name: once its heartbeat lapses a live worker's sweep reclaims them, or a restart
        under this name takes them back at once (take_name)."""
        with self._lock:
            left = {e.batch.key: e.batch for e in self.inflight.values()}
            left.update((b.key, b) for b, _, _ in self.retry)
            ids = sorted(b.batch_id for b in left.values())  # the stream ids, as before (a shard's may repeat)
            items = sum(len(b.items) for b in left.values())
            unwritten = (sum(len(r) for _, r, _ in self.retry)
                         + sum(len(e.results) - e.sent for e in self.inflight.values()))
            self.inflight.clear()
            self.retry.clear()
        event("left_pending", worker=self.name, batches=len(ids), items=items, unwritten_results=unwritten,
              redis_down_s=round(time.monotonic() - (self.link.down_since or time.monotonic()), 3),
              batch_ids=ids[:20])
        self.engine.close()
