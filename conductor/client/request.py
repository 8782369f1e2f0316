"""The request path (seed 004): one answer at a time for services, over the same queue.

``RequestClient(url, model=M)`` / ``AsyncRequestClient``: ``generate(prompt, ...)`` submits one
item through submit.lua (same packing, purity, at-least-once delivery and idempotent result as
any item) under the client's own request job (``rq.<hex>``) and blocks on the item's reply
list (``cdr:{M}:reply:<job>:<id>``), to which complete.lua pushes the result as it writes it:
no polling. The submit is sealed in the same round trip (seal.lua): a request must not wait
quiet_ms for the release gate.

A sharded model (issue 36) takes each request on its shape's shard, as a batch job's items
(shard_route.py): the item, its seal and its reply list are the shard's (``cdr:{M~s.k}:...``), the
model's doorbell rung in the same round trip; the job is registered and classed on a shard at its
first request there. A ``?cluster=1`` URL gives cluster clients: each command goes to the node
that owns its key's slot.

Admission is the token-level queue's: the model's ``max_waiting_tokens`` refuses with
``QueueFull`` (carrying the waiting figure). The permits (``max_in_flight``, 64 by default) only
bound what one client has in flight; ``capacity()`` is advisory and never gates.

Errors (conductor/errors.py): ``UnknownModel`` at construction when no live worker serves the
model; ``QueueFull``; ``RequestTimeout`` (no permit or no result in time); ``ClientClosed``;
``BadInput`` for a bad argument. Every one returns the request's permit.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from conductor.client import Conductor
from conductor.client.fleet import live_workers
from conductor.client.permits import Permits
from conductor.errors import BadInput, ClientClosed, QueueFull, RequestTimeout, UnknownModel
from conductor.formats.native import from_native
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import connect, connect_async
from conductor.redis_contract.records import JobClass, PreparedItem, Result, result_decoder
from conductor.redis_contract.rules import REPLY_TTL_MS
from conductor.redis_contract.script_calls import raise_script_error

MAX_TIMEOUT_S = 3600.0
SAFETY_MARGIN_S = 5.0  # a permit not given back this long after its request's timeout returns by itself
# A waiting request reads its reply list this long at a time, then looks whether a change of the
# model's shard count moved its item (_Core.follow): about the producers' own layout cache (LAYOUT_TTL_S).
FOLLOW_S = 2.0
_CLOSED = b"\x00closed"  # pushed to in-flight reply lists by close(): their waiters wake at once
_WAITING = re.compile(r"holds (\d+) waiting tokens")


@dataclass(frozen=True)
class Capacity:
    """Advisory: how loaded the model's queue is against the live fleet's budgets."""

    waiting_tokens: int
    max_waiting_tokens: int  # 0: no ceiling
    fleet_budget_tokens: int  # sum of live workers' max_batch_tokens
    workers: int

    @property
    def batches_waiting(self) -> float:
        """Waiting tokens in fleet-wide batches (0 with no live worker)."""
        return self.waiting_tokens / self.fleet_budget_tokens if self.fleet_budget_tokens else 0.0


def served_models(r: redis.Redis) -> list[str]:
    return [m for m in sorted(x.decode() if isinstance(x, bytes) else x for x in r.smembers(K.MODELS_KEY))
            if live_workers(r, m)]


def _check_timeout(timeout: float) -> float:
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise BadInput("timeout", f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout!r}")
    return float(timeout)


def _queue_full(e: QueueFull) -> QueueFull:
    m = _WAITING.search(str(e))
    return QueueFull(str(e), waiting=int(m.group(1)) if m else None)


def _script_reply(reply: Any) -> None:
    if isinstance(reply, Exception):
        try:
            raise_script_error(reply)
        except QueueFull as e:
            raise _queue_full(e) from None


class _Core:
    """What the sync and async clients share: the job, the item, the keys, the permits."""

    def __init__(self, url: str, model: str, max_in_flight: int, job_class: JobClass) -> None:
        self.url = url
        self.c = Conductor(connect(url))  # checks the schema
        self.mk = K.ModelKeys(model)
        self.model = model
        served = served_models(self.c.r)
        if model not in served:
            raise UnknownModel(model, served)
        self.permits = Permits(max_in_flight)
        self.job = f"{K.REQUEST_JOB_PREFIX}{secrets.token_hex(8)}"
        self.job_class = job_class
        self.c._register_job(self.job, model)
        # interactive by default: claimed before any batch work at the next claim (issue 26)
        self.c.set_job_class(self.job, [model], job_class)
        self.ready = {model}  # the model and the shards the job is registered and classed on
        self.route_lock = threading.Lock()  # the Conductor's layout cache is one thread's at a time
        self.closed = False
        self.waiting_on: set[str] = set()  # reply keys with a waiter, woken by close()
        self.submit_sha = self.c.r.script_load(self.c.scripts.submit.script)
        self.seal_sha = self.c.r.script_load(self.c.scripts.seal.script)

    def item(self, prompt: str, prefix: tuple[str, ...] | list[str], max_tokens: int, payload: Any) -> PreparedItem:
        return from_native({"id": secrets.token_hex(12), "model": self.model, "prefix": list(prefix),
                            "prompt": prompt, "max_tokens": max_tokens, "payload": payload})

    def place(self, it: PreparedItem) -> tuple[PreparedItem, K.ModelKeys]:
        """The item under the name that takes it (its shape's shard on a sharded model, else the
        model) and that name's keys; the job registered and classed there first (a shard's first
        request of this client: a few round trips, once). Blocking: the async client runs it in a
        thread when place_now cannot answer."""
        with self.route_lock:
            ((name, (placed,)),) = self.c.route({self.model: [it]}).items()
            if name not in self.ready:
                self.c._register_job(self.job, name)
                self.c.set_job_class(self.job, [name], self.job_class)
                self.ready.add(name)
        return placed, K.ModelKeys(name)

    def place_now(self, it: PreparedItem) -> tuple[PreparedItem, K.ModelKeys] | None:
        """place() when it needs no Redis read (the layout and the shape's shard cached, the job ready
        there) and the route lock is free, else None: the async client then runs place() in a thread.
        Never blocks, so the event loop may call it."""
        if not self.route_lock.acquire(blocking=False):
            return None
        try:
            got = self.c.route_cached(self.model, it)
        finally:
            self.route_lock.release()
        if got is None or got[0] not in self.ready:
            return None
        return got[1], K.ModelKeys(got[0])

    @staticmethod
    def slice_s(left: float) -> float:
        """How long one blocking read waits: what the request has left, at most FOLLOW_S."""
        return max(0.001, round(min(left, FOLLOW_S), 3))

    def follow(self, it: PreparedItem, keys: list[str]) -> None:
        """After a read that came back empty: where the item waits now. A change of the model's
        shard count moves a waiting request like any item (shard_migrate.py), to its shape's shard
        under the new count, where complete.lua then pushes its answer: that list goes first in
        ``keys`` (read blocking), the ones it left after it (read once a slice: it may have been
        answered there first)."""
        with self.route_lock:
            ((name, _),) = self.c.route({self.model: [it]}).items()
        key = K.ModelKeys(name).reply(self.job, it.id)
        if key not in keys:
            keys.insert(0, key)

    def commands(self, it: PreparedItem, mk: K.ModelKeys) -> list[tuple[Any, ...]]:
        """The submit and the seal as EVALSHA commands (their KEYS from script_calls.py); on a shard,
        the model's doorbell rung too (an idle worker of a sharded model waits on the model's)."""
        out = [calls.submit(mk, self.job, [it]).command(self.submit_sha), calls.seal(mk).command(self.seal_sha)]
        if mk.model != self.model:
            out += [("LPUSH", self.mk.doorbell, 1), ("LTRIM", self.mk.doorbell, 0, 15)]
        return out

    def names(self) -> list[str]:
        """The model's shards that may hold work (the model itself when it is not sharded)."""
        with self.route_lock:
            return self.c.shards(self.model)

    def queue_capacity_reads(self, pipe: Any, names: list[str]) -> None:
        """What capacity() needs, queued on a pipeline (sync or asyncio): waiting tokens of each
        shard (``names``), the model's ceiling, the registered contracts."""
        for name in names:
            pipe.hget(K.ModelKeys(name).intake, "tokens")
        pipe.hget(self.mk.cfg, "max_waiting_tokens")
        pipe.hgetall(self.mk.workers)

    def result(self, raw: bytes | str) -> Result:
        if raw == _CLOSED:
            raise ClientClosed("the request client was closed while this request waited")
        return result_decoder.decode(raw)

    def capacity(self, replies: list[Any], alive: list[str]) -> Capacity:
        import json
        *waiting, cfg_max, contracts = replies
        state = sum(int(x) for x in waiting if x is not None)
        budget = 0
        for name in alive:
            raw = contracts.get(name.encode())
            if raw:
                try:
                    budget += int(json.loads(raw).get("max_batch_tokens", 0))
                except (ValueError, AttributeError):
                    pass
        return Capacity(waiting_tokens=int(state or 0), max_waiting_tokens=int(cfg_max or 0),
                        fleet_budget_tokens=budget, workers=len(alive))


class _PermitCounts:
    _core: _Core

    @property
    def available_permits(self) -> int:
        return self._core.permits.available

    @property
    def in_flight(self) -> int:
        return self._core.permits.in_flight


class RequestClient(_PermitCounts):
    """Blocking request client; thread-safe (each waiting request holds a connection of its own)."""

    def __init__(self, url: str, *, model: str, max_in_flight: int = 64, tenant: str = "",
                 priority: str = "interactive") -> None:
        self._core = _Core(url, model, max_in_flight, JobClass(tenant, priority))
        self.model, self.job = model, self._core.job
        # Blocking reads wait as long as their request's timeout: no socket timeout under them.
        self._block = connect(url, blocking=True)
        self._lock = threading.Lock()

    def capacity(self) -> Capacity:
        """Advisory load figure; reads Redis, never waits for a permit."""
        r = self._core.c.r
        pipe = r.pipeline(transaction=False)
        self._core.queue_capacity_reads(pipe, self._core.names())
        return self._core.capacity(pipe.execute(), live_workers(r, self.model))

    def generate(self, prompt: str, *, prefix: tuple[str, ...] | list[str] = (), max_tokens: int,
                 timeout: float, payload: Any = None) -> Result:
        core = self._core
        if core.closed:
            raise ClientClosed("the request client is closed")
        timeout = _check_timeout(timeout)
        deadline = time.monotonic() + timeout
        it = core.item(prompt, prefix, max_tokens, payload)  # bad input refused before a permit is taken
        permit = core.permits.take(timeout + SAFETY_MARGIN_S, timeout)
        if permit is None:
            if core.closed:
                raise ClientClosed("the request client was closed while this request waited for a permit")
            raise RequestTimeout(f"no permit came back within {timeout:g}s ({core.permits.n} requests in flight)")
        try:
            if core.closed:
                raise ClientClosed("the request client is closed")
            it, mk = core.place(it)
            self._send(it, mk)
            return self._wait(it, [mk.reply(core.job, it.id)], deadline, timeout)
        finally:
            core.permits.give(permit)

    def _send(self, it: PreparedItem, mk: K.ModelKeys) -> None:
        core = self._core
        pipe = self._block.pipeline(transaction=False)
        for cmd in core.commands(it, mk):
            pipe.execute_command(*cmd)
        replies = pipe.execute(raise_on_error=False)
        if isinstance(replies[0], redis.exceptions.NoScriptError):
            core.submit_sha = self._block.script_load(core.c.scripts.submit.script)
            core.seal_sha = self._block.script_load(core.c.scripts.seal.script)
            cmds = core.commands(it, mk)
            try:
                replies = [self._block.execute_command(*cmds[0])]
            except redis.ResponseError as e:
                replies = [e]
            for cmd in cmds[1:]:
                self._block.execute_command(*cmd)
        _script_reply(replies[0])

    def _wait(self, it: PreparedItem, keys: list[str], deadline: float, timeout: float) -> Result:
        """The item's answer, read from keys[0] a slice at a time (_Core.follow may put another first)."""
        core = self._core
        while True:
            with self._lock:
                if core.closed:
                    raise ClientClosed("the request client was closed while this request waited")
                core.waiting_on.add(keys[0])
            try:
                left = deadline - time.monotonic()
                got = self._block.blpop([keys[0]], timeout=core.slice_s(left)) if left > 0 else None
            finally:
                with self._lock:
                    core.waiting_on.discard(keys[0])
            if got is not None:
                return core.result(got[1])
            if deadline - time.monotonic() <= 0:
                raise RequestTimeout(f"no result within {timeout:g}s (item {it.id} of job {core.job} stays queued)")
            core.follow(it, keys)
            for k in keys[1:]:  # a list it left: answered there before the item moved
                raw: Any = self._block.lpop(k)
                if raw is not None:
                    return core.result(raw)

    def close(self) -> None:
        """Refuse new requests and wake every waiting one with ClientClosed (their permits return)."""
        core = self._core
        with self._lock:
            core.closed = True
            keys = list(core.waiting_on)
        core.permits.close()
        if keys:
            pipe = core.c.r.pipeline(transaction=False)
            for k in keys:
                pipe.lpush(k, _CLOSED)
                pipe.pexpire(k, REPLY_TTL_MS)
            pipe.execute()

    def __enter__(self) -> RequestClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRequestClient(_PermitCounts):
    """asyncio request client; task-safe within its event loop. ``async with`` closes it."""

    def __init__(self, url: str, *, model: str, max_in_flight: int = 64, tenant: str = "",
                 priority: str = "interactive") -> None:
        self._core = _Core(url, model, max_in_flight, JobClass(tenant, priority))
        self.model, self.job = model, self._core.job
        self._r = connect_async(url)
        self._waiters: deque[asyncio.Future[Any]] = deque()

    async def capacity(self) -> Capacity:
        names = await asyncio.to_thread(self._core.names)
        async with self._r.pipeline(transaction=False) as pipe:
            self._core.queue_capacity_reads(pipe, names)
            replies = await pipe.execute()
        alive = await asyncio.to_thread(live_workers, self._core.c.r, self.model)
        return self._core.capacity(replies, alive)

    def _give(self, permit: int) -> None:
        self._core.permits.give(permit)
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                break

    async def _take(self, hold_s: float, wait_s: float) -> int:
        permits = self._core.permits
        deadline = time.monotonic() + wait_s
        while True:
            if self._core.closed:
                raise ClientClosed("the request client was closed while this request waited for a permit")
            p = permits.try_take(hold_s)
            if p is not None:
                return p
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"no permit came back within {wait_s:g}s ({permits.n} requests in flight)")
            soonest = permits.next_deadline()
            if soonest is not None:  # wake at a safety deadline too: a leaked permit comes back then
                left = min(left, max(0.0, soonest - time.monotonic()) + 0.001)
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                pass

    async def generate(self, prompt: str, *, prefix: tuple[str, ...] | list[str] = (), max_tokens: int,
                       timeout: float, payload: Any = None) -> Result:
        core = self._core
        if core.closed:
            raise ClientClosed("the request client is closed")
        timeout = _check_timeout(timeout)
        deadline = time.monotonic() + timeout
        it = core.item(prompt, prefix, max_tokens, payload)
        permit = await self._take(timeout + SAFETY_MARGIN_S, timeout)
        try:  # a cancelled task passes through here too (CancelledError): the permit returns
            if core.closed:
                raise ClientClosed("the request client is closed")
            # a thread hop only when placing reads Redis (a layout over LAYOUT_TTL_S old, a new shape)
            placed = core.place_now(it)
            if placed is None:
                placed = await asyncio.to_thread(core.place, it)
            it, mk = placed
            await self._send(it, mk)
            return await self._wait(it, [mk.reply(core.job, it.id)], deadline, timeout)
        finally:
            self._give(permit)

    async def _send(self, it: PreparedItem, mk: K.ModelKeys) -> None:
        core = self._core
        async with self._r.pipeline(transaction=False) as pipe:
            for cmd in core.commands(it, mk):
                pipe.execute_command(*cmd)
            replies = await pipe.execute(raise_on_error=False)
        if isinstance(replies[0], redis.exceptions.NoScriptError):
            core.submit_sha = await self._r.script_load(core.c.scripts.submit.script)
            core.seal_sha = await self._r.script_load(core.c.scripts.seal.script)
            cmds = core.commands(it, mk)
            try:
                replies = [await self._r.execute_command(*cmds[0])]
            except redis.ResponseError as e:
                replies = [e]
            for cmd in cmds[1:]:
                await self._r.execute_command(*cmd)
        _script_reply(replies[0])

    async def _wait(self, it: PreparedItem, keys: list[str], deadline: float, timeout: float) -> Result:
        """The item's answer, read from keys[0] a slice at a time (_Core.follow may put another first)."""
        core = self._core
        while True:
            if core.closed:
                raise ClientClosed("the request client was closed while this request waited")
            core.waiting_on.add(keys[0])
            try:
                left = deadline - time.monotonic()
                got = await self._r.blpop([keys[0]], timeout=core.slice_s(left)) if left > 0 else None
            finally:
                core.waiting_on.discard(keys[0])
            if got is not None:
                return core.result(got[1])
            if deadline - time.monotonic() <= 0:
                raise RequestTimeout(f"no result within {timeout:g}s (item {it.id} of job {core.job} stays queued)")
            await asyncio.to_thread(core.follow, it, keys)
            for k in keys[1:]:  # a list it left: answered there before the item moved
                raw = await self._r.lpop(k)
                if raw is not None:
                    return core.result(raw)

    async def close(self) -> None:
        core = self._core
        core.closed = True
        core.permits.close()
        keys = list(core.waiting_on)
        if keys:
            async with self._r.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.lpush(k, _CLOSED)
                    pipe.pexpire(k, REPLY_TTL_MS)
                await pipe.execute()
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    async def aclose(self) -> None:
        """Close, then release the connections once the waiters have woken."""
        await self.close()
        await asyncio.sleep(0)
        await self._r.aclose()

    async def __aenter__(self) -> AsyncRequestClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
