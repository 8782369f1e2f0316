"""One worker process per GPU: pull batches under the engine's contract, run them, write back.

The loop, once per turn:

1. Reclaim finished slots: one engine step hands back finished sequences; their results are
   written, and a batch whose last item finished is acknowledged.
2. Retry buffer first: result writes that failed (Redis away) are retried before anything new.
3. Pull only when the admission latch admits and there are free slots below the pending
   ceiling; the pull asks for at most that many items. Continuing decodes are outside the
   token budget: only new prefills count against it.
4. With nothing new, a progress-only step still advances the active sequences; an idle
   worker blocks on the model's doorbell (workers/doorbell.py: BLPOP, rung by submit.lua and
   seal.lua) until new work or its next timed duty (maintenance, quiet intake), instead of
   polling claim.lua (``wake="poll"``: the old back-off up to ``poll_max_s``).

A heartbeat thread renews the worker's heartbeat key and extends the lease on its in-flight
batches (XCLAIM to itself with JUSTID resets idle time without counting a delivery), so a
slow but live worker is never robbed by a reclaim.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import redis

from conductor.client import Conductor
from conductor.errors import ConductorError, Paused
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.records import Batch, Contract, Result, ResultError

from .doorbell import Doorbell, poll_sleep
from .engines.base import Engine, Finished
from .identity import default_worker_name
from .latch import AdmissionLatch
from .prewarm import Prewarm
from .sdnotify import Notifier
from .transient import RIDE_OUT, is_transient
from .worker_metrics import WorkerMetrics

log = logging.getLogger("conductor.worker")


def event(name: str, **fields: object) -> None:
    """One structured log line per event."""
    log.info(json.dumps({"event": name, **fields}, default=str))


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


@dataclass
class _InFlight:
    batch: Batch
    left: int
    results: list[Result] = field(default_factory=list)


class Worker:
    def __init__(self, conductor: Conductor, engine: Engine, opts: WorkerOptions | None = None) -> None:
        self.c = conductor
        self.engine = engine
        self.opts = opts or WorkerOptions()
        self.latch = AdmissionLatch(self.opts.high_water, self.opts.low_water)
        self.name = self.opts.name or default_worker_name()
        self.contract: Contract = engine.contract
        self.keys = K.ModelKeys(self.contract.model)
        self.inflight: dict[str, _InFlight] = {}
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
        self._wd_thread: threading.Thread | None = None
        self.notifier = Notifier()
        self.metrics = WorkerMetrics(self.contract.model, self.name, self.contract.max_batch_tokens)
        self.prewarm = Prewarm(conductor, engine, self.contract.model, self.name)

    # ------------------------------------------------------------------ lifecycle
    def register(self) -> None:
        c = self.contract
        self.c.ensure_model(c.model)
        # One allow-oom script (lua/register.lua): it works on a Redis over maxmemory, which a fresh
        # worker may be started to drain. The first consumer's contract becomes the model's
        # reference for "a full batch".
        shown = json.dumps({"max_batch_size": c.max_batch_size, "max_batch_tokens": c.max_batch_tokens,
                            "max_input_len": c.max_input_len, "engine": self.engine.kind, "pid": os.getpid()})
        set_tokens, set_items = calls.register(self.keys, self.name, shown, c, int(time.time() * 1000),
                                               max(1, int(self.opts.heartbeat_ttl_s * 1000))).run(self.c.scripts)
        if set_tokens or set_items:
            # Lanes that waited for this first worker were judged under the default budget.
            try:
                self.c.reindex(c.model)
            except Paused:
                event("reindex_deferred", worker=self.name, model=c.model)  # claim.lua re-derives lazily
        event("registered", worker=self.name, model=c.model, engine=self.engine.kind,
              max_batch_size=c.max_batch_size, max_batch_tokens=c.max_batch_tokens,
              max_input_len=c.max_input_len, high_water=self.latch.high, low_water=self.latch.low)

    def take_name(self) -> None:
        """Before a process starts working under its name: refuse a name a live worker uses (two
        processes sharing one consumer would reclaim each other's batches), and hand back at once
        what an earlier run under this name left pending (it died: its batches would otherwise
        wait for the stale sweep, minutes, since this run's heartbeat keeps the name alive)."""
        hb = self.keys.heartbeat(self.name)
        seen, ttl_ms = self.c.r.get(hb), self.c.r.pttl(hb)
        if seen is not None:
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
        if self.c.r.xpending_range(self.keys.batches, K.GROUP, "-", "+", 1, consumername=self.name):
            res = self.c.reclaim_consumer(self.contract.model, self.name, force=True)
            event("took_back", worker=self.name, batches=res["batches"], items=res["items"])

    def deregister(self) -> None:
        try:
            pipe = self.c.r.pipeline(transaction=False)
            pipe.hdel(self.keys.workers, self.name)
            pipe.hdel(self.keys.affinity, self.name)  # its instance is free for others to take whole
            pipe.hdel(self.keys.warming, self.name)
            pipe.delete(self.keys.heartbeat(self.name))
            pipe.execute()
            pending = self.c.r.xpending_range(self.keys.batches, K.GROUP, "-", "+", 1, consumername=self.name)
            if not pending:
                # DELCONSUMER discards pending entries: only once the list is empty.
                self.c.r.xgroup_delconsumer(self.keys.batches, K.GROUP, self.name)
        except (redis.RedisError, OSError) as e:
            event("deregister_failed", worker=self.name, error=str(e))
        event("deregistered", worker=self.name)

    def _heartbeat_loop(self) -> None:
        period = self.opts.heartbeat_ttl_s / 3
        while not self._hb_stop.wait(period):
            try:
                # lua/heartbeat.lua, allow-oom: a heartbeat refused over maxmemory would let a
                # live worker's batches be reclaimed and run twice.
                calls.heartbeat(self.keys, self.name, int(time.time() * 1000),
                                max(1, int(self.opts.heartbeat_ttl_s * 1000)), self.leased_ids()).run(self.c.scripts)
            except (redis.RedisError, OSError, ConductorError) as e:
                event("heartbeat_failed", worker=self.name, error=str(e))

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

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    # ------------------------------------------------------------------ results
    def _result(self, fin: Finished) -> Result:
        b, it = fin.batch, fin.item
        return Result(id=it.id, model=b.model, job=it.job, output=fin.output, output_tokens=fin.output_tokens,
                      error=fin.error, shape=b.shape, epoch=b.epoch, lane=b.lane, batch=b.batch_id,
                      batch_size=len(b.items), batch_padded_len=b.padded_len, input_tokens=it.input_tokens,
                      worker=self.name, claimed_at=b.claimed_at, finished_at=int(time.time() * 1000),
                      deliveries=it.deliveries, payload=it.payload)

    def _collect(self, finished: list[Finished]) -> None:
        for fin in finished:
            entry = self.inflight.get(fin.batch.batch_id)
            if entry is None:
                continue
            entry.results.append(self._result(fin))
            entry.left -= 1
            self.finished += 1
            self.output_tokens += fin.output_tokens
            if entry.left == 0:
                with self._lock:
                    del self.inflight[fin.batch.batch_id]
                    self.retry.append((entry.batch, entry.results, True))

    def _flush_writes(self) -> bool:
        """Write queued results, oldest first; False when Redis is away (kept for retry)."""
        while self.retry:
            batch, results, final = self.retry[0]
            try:
                self.c.complete(batch, results, final=final)
            except RIDE_OUT as e:
                if not is_transient(e):
                    raise
                event("complete_retry", worker=self.name, batch=batch.batch_id, error=str(e))
                return False
            with self._lock:
                self.retry.popleft()
            self.metrics.written(results)
        return True

    # ------------------------------------------------------------------ loop
    def pending(self) -> int:
        """Items pulled and not yet written back: in a batch still running (alive in the engine or
        finished beside siblings that are not) or waiting in the retry buffer."""
        with self._lock:
            return (sum(len(e.batch.items) for e in self.inflight.values())
                    + sum(len(results) for _, results, _ in self.retry))

    def free_slots(self) -> int | None:
        """How many items one pull may ask for (None: only the engine's contract limits it)."""
        limits = [x for x in (self.latch.room(self.engine.active()),
                              None if self.opts.pending_ceiling is None
                              else self.opts.pending_ceiling - self.pending()) if x is not None]
        return min(limits) if limits else None

    def _pull(self) -> bool:
        free = self.free_slots()
        if free is not None and free <= 0:
            return False
        size = self.contract.max_batch_size if free is None else min(self.contract.max_batch_size, free)
        contract = Contract(model=self.contract.model, max_batch_size=size,
                            max_batch_tokens=self.contract.max_batch_tokens,
                            max_input_len=self.contract.max_input_len)
        t = time.perf_counter()
        batch, self.last_claim = self.c.claim(contract, self.name)
        self.metrics.claim_took(time.perf_counter() - t)
        if batch is None:
            return False
        self.batches_claimed += 1
        self.metrics.claimed(batch)
        with self._lock:
            self.inflight[batch.batch_id] = _InFlight(batch, len(batch.items))
        items, unreadable = batch.items, [it for it in batch.items if it.unreadable]
        if unreadable:
            items = [it for it in batch.items if not it.unreadable]
            self._collect([Finished(batch, it, "", 0, ResultError("bad_record", it.unreadable)) for it in unreadable])
        try:
            refused = self.engine.admit(batch, items) if items else []
        except Exception as e:  # noqa: BLE001 - any engine failure: the batch goes back, the worker lives
            self._give_back_failed(batch, e)
            return True
        self._collect(refused)
        self.prewarm.after_claim(batch)
        return True

    def _give_back_failed(self, batch: Batch, err: Exception) -> None:
        """The engine could not take a batch: requeue it (fail.lua counts deliveries, dead-letters at N)."""
        with self._lock:
            self.inflight.pop(batch.batch_id, None)
        event("admit_failed", worker=self.name, batch=batch.batch_id, error=repr(err))
        try:
            self.c.fail(batch, self.name, f"engine {self.engine.kind}: {err!r}")
        except RIDE_OUT as e:
            # Left pending under this consumer: a reclaim after this worker stops picks it up.
            event("fail_write_failed", worker=self.name, batch=batch.batch_id, error=str(e))

    def _step(self) -> None:
        t = time.perf_counter()
        finished = self.engine.step()
        self.metrics.stepped(time.perf_counter() - t)
        self._collect(finished)

    def turn(self) -> bool:
        """One turn of the loop; returns whether anything happened."""
        busy = self._turn()
        self.metrics.state(self.engine.active(), self.latch.gated, self.latch.transitions, len(self.retry))
        self.metrics.engine_counters(getattr(self.engine, "counters", None))
        return busy

    def _turn(self) -> bool:
        busy = False
        if self.engine.active():
            self._step()
            busy = True
        if not self._flush_writes():
            return busy
        if self.stopping.is_set():
            return busy
        if self.opts.max_batches is not None and self.batches_claimed >= self.opts.max_batches:
            return busy
        if self.latch.admits(self.engine.active()):
            try:
                busy = self._pull() or busy
            except RIDE_OUT as e:
                if not is_transient(e):
                    raise
                event("claim_failed", worker=self.name, error=str(e))
        return busy

    def run(self) -> None:
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
        idle_since = time.monotonic()
        sleep = 0.001
        # The reclaim sweep runs in whichever live worker holds the model's maintenance lease.
        from .maintenance import Maintenance
        maint = Maintenance.for_worker(self.c, self.contract.model, self.name, self.opts.heartbeat_ttl_s)
        bell = Doorbell(self.c, self.contract.model) if self.opts.wake == "bell" else None
        rung = False
        try:
            while not self.stopping.is_set():
                maint.tick()
                claimed = self.batches_claimed
                if self.turn():
                    if rung and self.batches_claimed > claimed and bell is not None:
                        self._pass_on(bell)
                    rung = False
                    idle_since = time.monotonic()
                    sleep = 0.001
                    continue
                rung = False
                if self.opts.max_batches is not None and self.batches_claimed >= self.opts.max_batches \
                        and not self.inflight and not self.retry:
                    break
                if self.last_claim == "paused":
                    idle_since = time.monotonic()  # a paused model is not a finished one
                if self.opts.idle_exit_s is not None and time.monotonic() - idle_since > self.opts.idle_exit_s:
                    break
                if bell is None or self.retry:  # polling, or results waiting for Redis to come back
                    sleep = poll_sleep(sleep, self.opts.poll_max_s)
                    continue
                got = bell.wait_idle(maint.due_in(), self.opts.idle_exit_s, idle_since, self.last_claim)
                if got is None:
                    sleep = poll_sleep(sleep, self.opts.poll_max_s)
                rung = bool(got)
            self.drain()
        finally:
            self.stopping.set()
            self._stop_heartbeat()
            self.deregister()

    def _pass_on(self, bell: Doorbell) -> None:
        try:
            bell.pass_on()
        except RIDE_OUT as e:  # a hint only: the next worker's timed claim finds the work anyway
            event("bell_failed", worker=self.name, error=str(e))

    def _stop_heartbeat(self) -> None:
        """Before deregistering, so the thread cannot write the heartbeat key back after it is deleted."""
        self._hb_stop.set()
        for t in (self._hb_thread, self._wd_thread):
            if t is not None:
                t.join(timeout=5)

    def drain(self) -> None:
        """Stop pulling, finish in-flight work within ``drain_s``; what is left is handed back."""
        deadline = time.monotonic() + self.opts.drain_s
        event("draining", worker=self.name, active=self.engine.active(), inflight=len(self.inflight))
        self.notifier.stopping(f"draining {self.engine.active()} sequences for up to {self.opts.drain_s:g}s")
        while (self.engine.active() or self.retry) and time.monotonic() < deadline:
            if self.engine.active():
                self._step()
            if not self._flush_writes():
                time.sleep(0.05)
            self.metrics.state(self.engine.active(), self.latch.gated, self.latch.transitions, len(self.retry))
        if self.inflight:
            self.hand_back()
        self.metrics.state(self.engine.active(), self.latch.gated, self.latch.transitions, len(self.retry))
        event("drained", worker=self.name, finished=self.finished)

    def hand_back(self) -> None:
        """Write what finished, and give unfinished batches to the reclaimed queue at once."""
        with self._lock:
            for entry in self.inflight.values():
                if entry.results:
                    self.retry.append((entry.batch, entry.results, False))
        ids = [e.batch.batch_id for e in self.inflight.values()]
        try:
            self._flush_writes()
            res = self.c.reclaim_consumer(self.contract.model, self.name, force=True) if ids else {}
        except RIDE_OUT as e:
            # Redis is away: the batches stay pending under this name and the heartbeat key
            # expires, so the next reclaim sweep hands them on (as after a SIGKILL).
            event("hand_back_failed", worker=self.name, batches=len(ids), error=str(e))
            res = {}
        event("handed_back", worker=self.name, batches=len(ids), requeued=res.get("items", 0))
        with self._lock:
            self.inflight.clear()
        self.engine.close()

