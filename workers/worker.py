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
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import Batch, Contract, Result, ResultError

from .doorbell import Doorbell, poll_sleep
from .engines.base import Engine, EngineDead, EngineOutage, Finished
from .identity import host_name, owner, owner_gone, stable_worker_name
from .latch import AdmissionLatch
from .outage import Link, cut_retries
from .prewarm import Prewarm
from .sdnotify import Notifier
from .transient import RIDE_OUT, is_transient
from .worker_metrics import WorkerMetrics

# Claim answers that mean work waits but is held back (quiet intake, a batch not yet full, the
# release gate), as opposed to 'idle': nothing to do. Time idle after one counts as idle with work.
WORK_WAITS = ("wait", "gate")

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
    sent: int = 0  # results already queued for writing (an engine that streams them, as they finish)

    def unsent(self) -> list[Result]:
        out, self.sent = self.results[self.sent:], len(self.results)
        return out


class Worker:
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
        self.link = Link(conductor.r, self.keys.batches, self.name, self.contract.model)
        # Set when a heartbeat meets NOGROUP: Redis lost the model's keys without a dropped connection.
        self._rejoin_needed = threading.Event()
        # Only run()'s loop probes and joins Redis again after an outage; a subclass with a loop of its
        # own (the host agent) keeps reporting each failure as before.
        self._rides_out = False
        self.engine_dead = ""  # why the engine died, when it did: run() gives its batches back and raises

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

    def _outage(self, e: BaseException) -> bool:
        """True when ``e`` is Redis going away and the link says so (once per outage)."""
        return self._rides_out and self.link.lost(e)

    def _beat(self) -> None:
        # lua/heartbeat.lua, allow-oom: a heartbeat refused over maxmemory would let a live
        # worker's batches be reclaimed and run twice.
        calls.heartbeat(self.keys, self.name, int(time.time() * 1000), max(1, int(self.opts.heartbeat_ttl_s * 1000)),
                        self.leased_ids(), int(self.metrics.busy_s * 1000)).run(self.c.scripts)

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
        touched: dict[str, _InFlight] = {}
        for fin in finished:
            entry = self.inflight.get(fin.batch.batch_id)
            if entry is None:
                continue
            entry.results.append(self._result(fin))
            entry.left -= 1
            self.finished += 1
            self.output_tokens += fin.output_tokens
            touched[fin.batch.batch_id] = entry
            if entry.left == 0:
                with self._lock:
                    del self.inflight[fin.batch.batch_id]
                    self.retry.append((entry.batch, entry.unsent(), True))
        if getattr(self.engine, "streams_results", False):
            # Items of one batch finish far apart on an engine that batches continuously (a long
            # output beside short ones): each is written as it finishes, not when its batch ends.
            with self._lock:
                for entry in touched.values():
                    if entry.left:
                        self.retry.append((entry.batch, entry.unsent(), False))

    def _flush_writes(self) -> bool:
        """Write queued results, oldest first; False when Redis is away (kept for retry)."""
        while self.retry:
            batch, results, final = self.retry[0]
            try:
                self.c.complete(batch, results, final=final)
            except RIDE_OUT as e:
                if not is_transient(e):
                    raise
                if not self._outage(e):  # an outage is said once, by the link
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
        """How many items one pull may ask for (None: only the engine's contract limits it): the latch,
        the pending ceiling, and the engine's own room (an engine that queues says how much more it
        wants, so the worker holds about one batch beyond what runs)."""
        limits = [x for x in (self.latch.room(self.engine.active()),
                              None if self.opts.pending_ceiling is None
                              else self.opts.pending_ceiling - self.pending(),
                              self.engine.room()) if x is not None]
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
            if self.last_claim == "nogroup" and self._rides_out:
                self._rejoin_needed.set()  # the claim made the group again; the registration is gone too
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
        except EngineDead as e:  # not this batch's fault: it goes back with the rest as the worker stops
            self._engine_died(e)
            return True
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
            self._outage(e)
            event("fail_write_failed", worker=self.name, batch=batch.batch_id, error=str(e))

    def _step(self) -> None:
        t = time.perf_counter()
        try:
            finished = self.engine.step()
        except EngineOutage as e:
            self._engine_outage(e)
            return
        except EngineDead as e:
            self._engine_died(e)
            return
        self.metrics.stepped(time.perf_counter() - t)
        self._collect(finished)

    def _engine_died(self, err: EngineDead) -> None:
        """The engine cannot go on: stop; the drain gives every batch held back (run() then raises)."""
        event("engine_dead", worker=self.name, error=str(err))
        self.engine_dead = str(err)
        self.stopping.set()

    def _engine_outage(self, err: EngineOutage) -> None:
        """What serves the engine went away: its unfinished items go back to Redis (served first by
        whoever claims next, this worker too once the engine has room again), not answered as failed."""
        with self._lock:
            batches, items = len(self.inflight), sum(e.left for e in self.inflight.values())
        event("engine_outage", worker=self.name, batches=batches, items=items, error=str(err))
        self._give_back_inflight()

    def turn(self) -> bool:
        """One turn of the loop; returns whether anything happened."""
        busy = self._turn()
        self._account()
        return busy

    def _account(self) -> None:
        self.metrics.state(self.engine.active(), self.latch.gated, self.latch.transitions, len(self.retry))
        self.metrics.engine_counters(getattr(self.engine, "counters", None))
        self.metrics.clock(self.engine.active() > 0, self.last_claim in WORK_WAITS)

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
                if self._outage(e):
                    self.last_claim = ""  # what waits is unknown while Redis is away
                else:
                    event("claim_failed", worker=self.name, error=str(e))
        return busy

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

    def run(self) -> None:
        """Serve until stopped (or idle, or done with --max-batches); an engine that died ends it with
        EngineDead once its batches went back."""
        self._serve()
        if self.engine_dead:
            raise EngineDead(f"{self.engine_dead}; its batches went back to the queue")

    def _serve(self) -> None:
        self._start()
        idle_since = time.monotonic()
        sleep = 0.001
        # The reclaim sweep runs in whichever live worker holds the model's maintenance lease.
        from .maintenance import Maintenance
        maint = Maintenance.for_worker(self.c, self.contract.model, self.name, self.opts.heartbeat_ttl_s)
        maint.on_error = self._outage  # an outage is said once, by the link
        bell = Doorbell(self.c, self.contract.model) if self.opts.wake == "bell" else None
        rung = False
        # From here on the worker rides outages out itself (workers/outage.py): the client's own
        # retries end once it knows Redis is away, or once it is told to stop.
        cut_retries(self.c.r, lambda: self.link.down or self.stopping.is_set())
        self._rides_out = True
        try:
            while not self.stopping.is_set():
                if self.link.down or self._rejoin_needed.is_set():
                    self._ride_out()
                    idle_since = time.monotonic()  # an outage is not idleness (--idle-exit)
                    continue
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
                if self.link.down:
                    continue
                # polling, results waiting for Redis to come back, or an engine not taking work (a server
                # away): a doorbell would not ring when it is back
                if bell is None or self.retry or self.engine.room() == 0:
                    sleep = poll_sleep(sleep, self.opts.poll_max_s)
                    continue
                got = bell.wait_idle(maint.due_in(), self.opts.idle_exit_s, idle_since, self.last_claim,
                                     on_error=self._outage)
                if got is None:
                    sleep = poll_sleep(sleep, self.opts.poll_max_s)
                rung = bool(got)
            self.drain()
        finally:
            self.stopping.set()
            self._stop_heartbeat(1.0 if self.link.down else 5.0)
            if not self.link.down:  # else drain said what it left; deregistering would wait for the server
                self.deregister()

    def _pass_on(self, bell: Doorbell) -> None:
        try:
            bell.pass_on()
        except RIDE_OUT as e:  # a hint only: the next worker's timed claim finds the work anyway
            if not self._outage(e):
                event("bell_failed", worker=self.name, error=str(e))

    def _stop_heartbeat(self, timeout: float = 5.0) -> None:
        """Before deregistering, so the thread cannot write the heartbeat key back after it is deleted.
        Both threads are daemons: one still inside a Redis call does not hold the process."""
        self._hb_stop.set()
        for t in (self._hb_thread, self._wd_thread):
            if t is not None:
                t.join(timeout=timeout)

    # ------------------------------------------------------------------ outages
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
        mine = set() if lost_group else {as_str(p["message_id"]) for p in pending}
        with self._lock:
            gone = {e.batch.batch_id: e.batch for e in self.inflight.values() if e.batch.batch_id not in mine}
            gone.update((b.batch_id, b) for b, _, _ in self.retry if b.batch_id not in mine)
            for bid in gone:
                self.inflight.pop(bid, None)
            self.retry = deque(r for r in self.retry if r[0].batch_id not in gone)
        if lost_group or not registered:
            self.c.ensure_model(self.contract.model, force=True)
            self.register(say=False)
        else:
            self._beat()  # the lease of what is still pending, renewed before it lapses
        out = {"rejoined": int(lost_group or not registered)}
        if gone:
            out.update(dropped_batches=len(gone), dropped_items=sum(len(b.items) for b in gone.values()))
        return out

    def drain(self) -> None:
        """Stop pulling, finish in-flight work within ``drain_s``; what is left is handed back. With
        Redis away, within ``drain_s`` too: what cannot be written or handed back is left pending
        under this name, and said in one line."""
        deadline = time.monotonic() + self.opts.drain_s
        event("draining", worker=self.name, active=self.engine.active(), inflight=len(self.inflight))
        self.notifier.stopping(f"draining {self.engine.active()} sequences for up to {self.opts.drain_s:g}s")
        while (self.engine.active() or self.retry) and time.monotonic() < deadline:
            if self.link.down or self._rejoin_needed.is_set():
                self._ride_out(deadline - time.monotonic())
                continue
            if self.engine.active():
                self._step()
            if not self._flush_writes():
                time.sleep(0.05)
            self._account()
        if self.link.down and not self._reconnect(max(0.0, deadline - time.monotonic())):
            self._leave_pending()
            return
        if self.inflight:
            self.hand_back()
        self._account()
        event("drained", worker=self.name, finished=self.finished)

    def _leave_pending(self) -> None:
        """Stopping with Redis away: nothing more can be written. The batches stay pending under
        this name: once its heartbeat lapses a live worker's sweep reclaims them, or a restart
        under this name takes them back at once (take_name)."""
        with self._lock:
            left = {e.batch.batch_id: e.batch for e in self.inflight.values()}
            left.update((b.batch_id, b) for b, _, _ in self.retry)
            ids = sorted(left)
            items = sum(len(b.items) for b in left.values())
            unwritten = (sum(len(r) for _, r, _ in self.retry)
                         + sum(len(e.results) - e.sent for e in self.inflight.values()))
            self.inflight.clear()
            self.retry.clear()
        event("left_pending", worker=self.name, batches=len(ids), items=items, unwritten_results=unwritten,
              redis_down_s=round(time.monotonic() - (self.link.down_since or time.monotonic()), 3),
              batch_ids=ids[:20])
        self.engine.close()

    def hand_back(self) -> None:
        """Write what finished, and give unfinished batches to the reclaimed queue at once."""
        self._give_back_inflight()
        self.engine.close()

    def _give_back_inflight(self) -> None:
        with self._lock:
            for entry in self.inflight.values():
                if entry.sent < len(entry.results):
                    self.retry.append((entry.batch, entry.unsent(), False))
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

