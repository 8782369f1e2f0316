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
   polling claim.lua (``wake="poll"``: the old back-off up to ``poll_max_s``); with nothing
   waiting at all, one BLPOP and one lua/idle_beat.lua call a beat (workers/idle.py).

How much a pull asks for is workers/pacing.py's (claims follow the engine); the worker's start,
name, registration and heartbeat are workers/worker_start.py's; riding out a Redis outage is
workers/outage.py's.
"""

from __future__ import annotations

import time

from conductor.redis_contract.records import Batch, Result, ResultError
from conductor.redis_contract.shards import fold

from . import pacing
from .doorbell import Doorbell, poll_sleep
from .engines.base import EngineDead, EngineOutage, Finished
from .held import InFlight, event
from .idle import IdleBeat
from .outage import OutageHandling, cut_retries
from .transient import RIDE_OUT, is_transient
from .worker_start import WorkerOptions, WorkerStart

__all__ = ["WORK_WAITS", "Worker", "WorkerOptions", "event"]

# Claim answers that mean work waits but is held back (quiet intake, a batch not yet full, the
# release gate), as opposed to 'idle': nothing to do. Time idle after one counts as idle with work.
WORK_WAITS = ("wait", "gate")


class Worker(WorkerStart, OutageHandling):
    idle: IdleBeat | None = None  # the idle wait once serving (tests read its beats and rings)

    def _busy_bell(self) -> Doorbell:
        """The loop's doorbell; one of its own for a worker driven turn by turn (the benches' drive)."""
        if self.bell is None:
            self.bell = Doorbell(self.c, self.shards.bell_model())
        return self.bell

    def _take_ring(self) -> bool:
        """One entry off the doorbell, if there is one: a ring (new work, or one nobody took) lets a
        claim through while the engine runs (pacing.BusyIdle)."""
        return self.c.r.lpop(self._busy_bell().keys.doorbell) is not None

    # ------------------------------------------------------------------ results
    def _result(self, fin: Finished) -> Result:
        b, it = fin.batch, fin.item
        return Result(id=it.id, model=fold(b.model), job=it.job, output=fin.output, output_tokens=fin.output_tokens,
                      error=fin.error, shape=b.shape, epoch=b.epoch, lane=b.lane, batch=b.batch_id,
                      batch_size=len(b.items), batch_padded_len=b.padded_len, input_tokens=it.input_tokens,
                      worker=self.name, claimed_at=b.claimed_at, finished_at=int(time.time() * 1000),
                      deliveries=it.deliveries, payload=it.payload)

    def _collect(self, finished: list[Finished]) -> None:
        touched: dict[str, InFlight] = {}
        for fin in finished:
            entry = self.inflight.get(fin.batch.key)
            if entry is None:
                continue
            entry.results.append(self._result(fin))
            entry.left -= 1
            self.finished += 1
            self.output_tokens += fin.output_tokens
            touched[fin.batch.key] = entry
            if entry.left == 0:
                with self._lock:
                    del self.inflight[fin.batch.key]
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
        the pending ceiling, and the engine's own room (workers/pacing.py)."""
        return pacing.free_slots(self.latch, self.engine, self.opts.pending_ceiling, self.pending)

    def _pull(self) -> bool:
        contract = pacing.claim_contract(self.contract, self.free_slots())
        if contract is None:
            return False
        if self.opts.wake == "bell" and not self.busy_idle.due(self.engine.active() > 0, self.clock(),
                                                               self._take_ring):
            return False
        t = time.perf_counter()
        batch, self.last_claim = self.shards.claim(contract, self.name)
        self.metrics.claim_took(time.perf_counter() - t)
        self.busy_idle.answered(self.last_claim, self.engine.active() > 0, self.clock(),
                                self._busy_bell().quiet_s if self.opts.wake == "bell" else None)
        if self.busy_idle.rang and batch is not None:  # as a rung idle worker does: the next one wakes if work is left
            self._pass_on(self._busy_bell())  # a hint: a Redis error here must not lose the batch just claimed
        if batch is None:
            if self.last_claim == "nogroup" and self._rides_out:
                self._rejoin_needed.set()  # the claim made the group again; the registration is gone too
            return False
        self.batches_claimed += 1
        self.metrics.claimed(batch)
        with self._lock:
            self.inflight[batch.key] = InFlight(batch, len(batch.items))
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
            self.inflight.pop(batch.key, None)
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
        from .shard_maintenance import for_worker
        maint = for_worker(self.c, self.shards, self.name, self.opts.heartbeat_ttl_s)  # each shard's too
        maint.on_error = self._outage  # an outage is said once, by the link
        bell = Doorbell(self.c, self.shards.bell_model()) if self.opts.wake == "bell" else None
        idle = IdleBeat(self, maint, bell) if bell is not None else None  # the wait on the bell
        self.idle = idle
        self.bell = bell
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
                if idle is None or self.retry or self.engine.room() == 0:
                    sleep = poll_sleep(sleep, self.opts.poll_max_s)
                    continue
                got = idle.wait(self.last_claim, self.opts.idle_exit_s, idle_since, on_error=self._outage)
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
            res = self.members.reclaim(self.name) if ids else {}
        except RIDE_OUT as e:
            # Redis is away: the batches stay pending under this name and the heartbeat key
            # expires, so the next reclaim sweep hands them on (as after a SIGKILL).
            event("hand_back_failed", worker=self.name, batches=len(ids), error=str(e))
            res = {}
        event("handed_back", worker=self.name, batches=len(ids), requeued=res.get("items", 0))
        with self._lock:
            self.inflight.clear()
