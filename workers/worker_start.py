"""A worker's start and standing: its state, its name (taken free or checked unused), its registration,
its heartbeat and watchdog threads, and its signals. The loop that claims and runs batches is
workers/worker.py's ``Worker``, built on this; riding out a Redis outage is workers/outage.py's.

A heartbeat thread renews the worker's heartbeat key and extends the lease on its in-flight
batches (XCLAIM to itself with JUSTID resets idle time without counting a delivery), so a
slow but live worker is never robbed by a reclaim.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis

from conductor.client import Conductor
from conductor.client.shard_claims import ShardClaims
from conductor.errors import ConductorError, Paused
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.records import Batch, Contract, Result

from .doorbell import Doorbell
from .engines.base import Engine
from .held import InFlight, event
from .identity import host_name, owner, owner_gone, stable_worker_name
from .latch import AdmissionLatch
from .outage import Link
from .pacing import BusyIdle
from .prewarm import Prewarm
from .sdnotify import Notifier
from .shard_maintenance import ShardMembers
from .worker_metrics import WorkerMetrics


@dataclass
class WorkerOptions:
    name: str = ""
    high_water: int | None = None
    low_water: int | None = None
    pending_ceiling: int | None = None
    heartbeat_ttl_s: float = 10.0
    poll_max_s: float = 0.05
    wake: str = "bell"  # "bell": block on the model's doorbell when idle; "poll": back off up to poll_max_s
    drain_s: float = 30.0
    max_batches: int | None = None  # stop after this many claimed batches (tests, benchmarks)
    idle_exit_s: float | None = None  # exit after this long with nothing to do


class WorkerStart:
    """A worker's state and what it does before and around its loop: take its name, register, keep its
    heartbeat (and systemd's watchdog), deregister (workers/worker.py's ``Worker`` is the loop)."""

    def __init__(self, conductor: Conductor, engine: Engine, opts: WorkerOptions | None = None) -> None:
        self.c = conductor
        self.engine = engine
        self.opts = opts or WorkerOptions()
        self.latch = AdmissionLatch(self.opts.high_water, self.opts.low_water)
        stable = self.opts.name or stable_worker_name()
        self.name = stable or host_name()
        # Without a stable name the worker takes a free one of its host's at start (take_name).
        self._stem = "" if stable else self.name
        self.contract: Contract = engine.contract
        self.keys = K.ModelKeys(self.contract.model)
        # the model's shards, when it has some (issue 36): claims rotate over them, the rest is on each
        self.shards = ShardClaims(conductor, self.contract.model)
        self.members = ShardMembers(conductor, self.shards)
        self.inflight: dict[str, InFlight] = {}  # by Batch.key
        self.retry: deque[tuple[Batch, list[Result], bool]] = deque()
        self.stopping = threading.Event()
        # Separate from ``stopping``: leases must keep being extended while the worker drains.
        self._hb_stop = threading.Event()
        self.batches_claimed = 0
        self.last_claim = ""  # the reason the last claim gave (batch, wait, idle, paused, ...)
        self.finished = 0
        self.output_tokens = 0
        self._lock = threading.Lock()
        self._hb_thread: threading.Thread | None = None
        # When the heartbeat thread beats next (monotonic): a third of the TTL after its last beat, or
        # later, set by an idle worker's beat (workers/idle.py) that renewed the key itself.
        self.hb_due = time.monotonic() + self.opts.heartbeat_ttl_s / 3
        self._wd_thread: threading.Thread | None = None
        self.notifier = Notifier()
        self.metrics = WorkerMetrics(self.contract.model, self.name, self.contract.max_batch_tokens)
        self.prewarm = Prewarm(conductor, engine, self.contract.model, self.name)
        self.link = Link(conductor.r, self.keys.batches, self.name, self.contract.model)
        # Set when a heartbeat meets NOGROUP: Redis lost the model's keys without a dropped connection.
        self._rejoin_needed = threading.Event()
        # Only run()'s loop probes and joins Redis again after an outage; a subclass with a loop of its
        # own (the host agent) keeps reporting each failure as before.
        self._rides_out = False
        self.engine_dead = ""  # why the engine died, when it did: run() gives its batches back and raises
        self.bell: Doorbell | None = None  # the loop's doorbell, once it runs: a stop signal cuts its wait
        # the clock of the claim pacing (pacing.BusyIdle); the benches' simulated-time drive sets its own
        self.clock: Callable[[], float] = time.monotonic
        self.busy_idle = BusyIdle()

    # ------------------------------------------------------------------ lifecycle
    def register(self, say: bool = True) -> None:
        c = self.contract
        self.c.ensure_model(c.model)
        # One allow-oom script (lua/register.lua): it works on a Redis over maxmemory, which a fresh
        # worker may be started to drain. The first consumer's contract becomes the model's
        # reference for "a full batch".
        shown = json.dumps({"max_batch_size": c.max_batch_size, "max_batch_tokens": c.max_batch_tokens,
                            "max_input_len": c.max_input_len, "engine": self.engine.kind, **owner()})
        set_tokens, set_items = calls.register(self.keys, self.name, shown, c, int(time.time() * 1000),
                                               max(1, int(self.opts.heartbeat_ttl_s * 1000))).run(self.c.scripts)
        self.members.register(self.name, shown, c, max(1, int(self.opts.heartbeat_ttl_s * 1000)))
        if set_tokens or set_items:
            # Lanes that waited for this first worker were judged under the default budget.
            try:
                self.c.reindex(c.model)
            except Paused:
                event("reindex_deferred", worker=self.name, model=c.model)  # claim.lua re-derives lazily
        if not say:
            return
        event("registered", worker=self.name, model=c.model, engine=self.engine.kind,
              max_batch_size=c.max_batch_size, max_batch_tokens=c.max_batch_tokens,
              max_input_len=c.max_input_len, high_water=self.latch.high, low_water=self.latch.low)

    def take_name(self) -> None:
        """Before a process starts working under its name. Without a stable name: the first free one
        of host, host-2, ... (lua/take_name.lua, atomic across workers starting at once). With one:
        refuse it while a live worker uses it (two processes sharing one consumer would reclaim each
        other's batches). Either way, hand back at once what an earlier run under the name left
        pending (it died: its batches would otherwise wait for the stale sweep, minutes, since this
        run's heartbeat keeps the name alive)."""
        if self._stem:
            name = calls.take_name(self.keys, self._stem, int(time.time() * 1000),
                                   max(1, int(self.opts.heartbeat_ttl_s * 1000))).run(self.c.scripts)
            if name is None:
                raise ConductorError(f"no free worker name for {self.contract.model}: {self._stem} and its "
                                     f"numbered names are all in use; give this worker its own --name")
            self._rename(name)
        else:
            self._wait_out_live_owner()
        if self.c.r.xpending_range(self.keys.batches, K.GROUP, "-", "+", 1, consumername=self.name):
            res = self.c.reclaim_consumer(self.contract.model, self.name, force=True)
            event("took_back", worker=self.name, batches=res["batches"], items=res["items"])
        self.members.take_back(self.name)

    def _wait_out_live_owner(self) -> None:
        hb = self.keys.heartbeat(self.name)
        seen, ttl_ms = self.c.r.get(hb), self.c.r.pttl(hb)
        if seen is None:
            return
        shown = self.c.r.hget(self.keys.workers, self.name)
        try:
            reg = json.loads(shown) if shown is not None else None
        except ValueError:
            reg = None
        if isinstance(reg, dict) and owner_gone(reg):
            return  # its process ended on this host (a restart under systemd): no need to wait out its TTL
        # a live owner renews its heartbeat (a new value) before the key expires; a dead one does not
        deadline = time.monotonic() + max(0, ttl_ms) / 1000 + 0.1
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.c.r.get(hb)
            if now is None:
                break
            if now != seen:
                raise ConductorError(f"worker name {self.name!r} is in use by a live worker of "
                                     f"{self.contract.model}; give each worker its own --name")

    def _rename(self, name: str) -> None:
        """The series and log lines made under the stem before the name was known go under the name."""
        if name == self.name:
            return
        self.metrics.forget()
        self.name = name
        self.metrics = WorkerMetrics(self.contract.model, name, self.contract.max_batch_tokens)
        self.prewarm.worker = self.link.worker = name

    def deregister(self) -> None:
        try:
            pipe = self.c.r.pipeline(transaction=False)
            pipe.hdel(self.keys.workers, self.name)
            pipe.hdel(self.keys.affinity, self.name)  # its instance is free for others to take whole
            pipe.hdel(self.keys.warming, self.name)
            pipe.hdel(self.keys.busy, self.name)
            if self.members.others():  # a sharded model's index of idle beats (lua/idle_beat.lua)
                pipe.zrem(self.keys.beats, self.name)
            pipe.delete(self.keys.heartbeat(self.name))
            pipe.execute()
            pending = self.c.r.xpending_range(self.keys.batches, K.GROUP, "-", "+", 1, consumername=self.name)
            if not pending:
                # DELCONSUMER discards pending entries: only once the list is empty.
                self.c.r.xgroup_delconsumer(self.keys.batches, K.GROUP, self.name)
            self.members.deregister(self.name)
        except (redis.RedisError, OSError) as e:
            event("deregister_failed", worker=self.name, error=str(e))
        event("deregistered", worker=self.name)

    def _heartbeat_loop(self) -> None:
        period = self.opts.heartbeat_ttl_s / 3
        while not self._hb_stop.wait(max(0.0, self.hb_due - time.monotonic())):
            if time.monotonic() < self.hb_due:
                continue  # an idle worker's beat renewed the key meanwhile: this thread sends nothing
            self.hb_due = time.monotonic() + period
            if self._rides_out and (self.link.down or self._rejoin_needed.is_set()):
                continue  # the main loop probes, and joins Redis again before heartbeats resume
            try:
                self._beat()
            except (redis.RedisError, OSError, ConductorError) as e:
                if self._outage(e):
                    continue
                if self._rides_out and "NOGROUP" in str(e):
                    self._rejoin_needed.set()
                event("heartbeat_failed", worker=self.name, error=str(e))
            except Exception as e:  # noqa: BLE001 - a bug in one beat must not end the thread: the leases would
                # lapse while the worker runs their batches, and a sweep would hand them to another
                event("heartbeat_failed", worker=self.name, error=repr(e))

    def _outage(self, e: BaseException) -> bool:
        """True when ``e`` is Redis going away and the link says so (once per outage)."""
        return self._rides_out and self.link.lost(e)

    def _beat(self, claiming: bool = False) -> None:
        """Every keyspace's heartbeat; on a sharded model, the model's holding mark too while this worker
        holds batches, or (``claiming``) is about to claim: an idle lease holder, whose quiet shards'
        sweeps wait for their turns, sweeps them while it lives (workers/idle.py)."""
        # lua/heartbeat.lua, allow-oom: a heartbeat refused over maxmemory would let a live
        # worker's batches be reclaimed and run twice.
        ids = self.leased_ids()
        holding = (claiming or bool(ids)) and bool(self.members.others())
        calls.heartbeat(self.keys, self.name, int(time.time() * 1000), max(1, int(self.opts.heartbeat_ttl_s * 1000)),
                        ids, int(self.metrics.busy_s * 1000), holding=holding).run(self.c.scripts)
        with self._lock:
            held = [e.batch for e in self.inflight.values()] + [b for b, _, _ in self.retry]
        self.members.beat(self.name, max(1, int(self.opts.heartbeat_ttl_s * 1000)), held,
                          int(self.metrics.busy_s * 1000))

    def _watchdog_loop(self, every: float) -> None:
        # Its own thread, not the heartbeat's: that one can sit for many seconds in Redis
        # reconnects, and systemd must not kill a worker that is riding out an outage.
        while not self._hb_stop.wait(every):
            self.notifier.watchdog()

    def leased_ids(self) -> list[str]:
        """Batches this worker still owes results for: running ones and those waiting to be written."""
        with self._lock:
            ids = [b.batch.batch_id for b in self.inflight.values()]
            ids += [batch.batch_id for batch, _, _ in self.retry if batch.batch_id not in ids]
        return ids

    def request_stop(self, *_: object) -> None:
        self.stopping.set()

    def _stop_signal(self, *_: object) -> None:
        self.stopping.set()
        if self.bell is not None:
            self.bell.interrupt()  # an idle wait ends now, not at its BLPOP's timeout

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._stop_signal)
        signal.signal(signal.SIGINT, self._stop_signal)

    def _start(self) -> None:
        self.c.ensure_model(self.contract.model)
        self.take_name()
        self.register()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._hb_thread.start()
        if self.notifier.enabled and self.notifier.watchdog_s:
            self.notifier.watchdog()
            self._wd_thread = threading.Thread(target=self._watchdog_loop, args=(self.notifier.watchdog_s,),
                                               name="watchdog", daemon=True)
            self._wd_thread.start()
        self.notifier.ready(f"pulling for {self.contract.model} ({self.engine.kind}) as {self.name}")

    def _stop_heartbeat(self, timeout: float = 5.0) -> None:
        """Before deregistering, so the thread cannot write the heartbeat key back after it is deleted.
        Both threads are daemons: one still inside a Redis call does not hold the process."""
        self._hb_stop.set()
        for t in (self._hb_thread, self._wd_thread):
            if t is not None:
                t.join(timeout=timeout)
