"""Periodic work (reclaim sweep, thrash alarm, counter drift check, resuming intake tasks whose
process died) run by whichever worker holds a short lease.

No central daemon is needed for correctness: any live worker of a model can sweep, and the
lease (SET NX PX, renewed by its holder) keeps it to one at a time. An idle worker takes or renews
it in its beat (lua/idle_beat.lua, workers/idle.py), not with a lease call of its own every second.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable

from conductor.client import Conductor
from conductor.errors import QueueFull
from conductor.intake.intake_resume import Resumer
from conductor.jobs.job_state import expire_due_leased, first_deadline
from conductor.jobs.retention import trim_model
from conductor.observability import metrics
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import StreamEntry
from conductor.redis_contract.keys import ModelKeys
from conductor.tier.compact_ids import compact_model
from conductor.tier.feeder import Feeder
from conductor.tier.object_store import StoreError
from conductor.tier.result_segments import offload_model
from conductor.tier.room import make_room, memory_pressure

from .feed_stall import FeedStall
from .transient import RIDE_OUT

log = logging.getLogger("conductor.maintenance")
# What the sweep and the feeder ride out: a Redis failure, a paused model (Paused), memory full
# (QueueFull), a store that does not answer.
RIDE_OUT_OR_STORE: tuple[type[BaseException], ...] = (*RIDE_OUT, StoreError)


# Every this many seconds a sweep also reads what an idle one skips (dead consumers holding nothing;
# on a shard, its trim and finished shapes; the model's tenants' service over its shards).
FULL_SWEEP_S = 10.0
# A quiet part (an idle holder's, nothing in flight, no intake task open, no deadline near: see
# ``quiet_s``) does its full sweep this seldom once the first after its busy spell has run: what that
# sweep reads (dead consumers holding nothing, acknowledged entries, finished shapes) does not grow
# while nothing runs, and a dead consumer holding nothing counts nowhere once its heartbeats lapse (on
# a sharded model the holder's beat is told of a worker that dies idle and forgets it on every part at
# once: ShardMaintenance.forget_lapsed). Its cost is an EXISTS per consumer (two on a shard): at 300 s
# the parts' full sweeps were the largest share of what the idle holder of every part of 3 shards sent
# (0.24 of 1.24 commands a second with 8 consumers), and they grow with the fleet.
QUIET_FULL_SWEEP_S = 3600.0
# and its counter drift check (conductor/verify/, every ``verify_interval_s`` otherwise) this many times
# more seldom: the counters and what they count do not move while nothing runs (about 20 commands a
# part; a wake brings the check back within ``verify_interval_s``)
QUIET_VERIFY_FACTOR = 60


class Maintenance:
    def __init__(self, conductor: Conductor, model: str, owner: str, *, interval_s: float = 1.0,
                 lease_ms: int = 5000, stale_idle_ms: int = 300_000, thrash_batches: int = 100,
                 verify_interval_s: float | None = None) -> None:
        self.c = conductor
        self.keys = ModelKeys(model)
        self.model = model
        self.owner = owner
        self.interval_s = interval_s
        self.lease_ms = lease_ms
        self.stale_idle_ms = stale_idle_ms
        self.thrash_batches = thrash_batches
        self._next = 0.0
        self._full_next = 0.0  # the next sweep that also forgets dead consumers holding nothing
        # a shard of a sharded model (workers/shard_maintenance.py): its tick leaves the global duties
        # to the model's own part; and every part a worker ticks (a shard, the model's own keys) reads
        # less while nothing is in flight there (defer_when_idle)
        self.shard = False
        self.defer_when_idle = False
        self.in_flight = 0  # batches pending at the last sweep (reclaim_dead's in_flight)
        # An idle lease holder's part is quiet (issue 36) while its last look saw nothing in flight, no
        # intake task open and no job's deadline within ``quiet_s``: then the idle wait (workers/idle.py)
        # ticks it every ``quiet_s`` (0: never quiet; a worker's part is given its idle beat's period)
        # instead of every ``interval_s``, at a beat, whose lease answer and pending count
        # (lua/idle_beat.lua) stand for the sweep's lease.lua call and XPENDING. A ring, the worker's
        # leaving its idle wait (``wake``) or a beat that tells of a batch in flight ends it.
        self.quiet_s = 0.0
        self.quiet = False
        self._told_idle_until = 0.0  # until when a beat's "nothing in flight" stands for the XPENDING
        self._stretched = False  # the last beat renewed the lease past lease_ms (a quiet spell's)
        self.next_deadline: float | None = None  # the earliest job deadline seen (epoch seconds)
        self._finished_cursor = "$"
        self.batches_per_shape: list[int] = []
        # Counter drift check (conductor/verify/): reads every waiting entry in bounded steps,
        # so it runs seldom and in a thread of its own; 0 turns it off.
        if verify_interval_s is None:
            verify_interval_s = float(os.environ.get("CONDUCTOR_VERIFY_INTERVAL_S", "60"))
        self.verify_interval_s = verify_interval_s
        # The first check comes with the first lease: the drift series (the dashboard's panel, the
        # ConductorCounterDrift alert) then exist from the start, with a measured value, instead
        # of a blank panel until the first interval has passed (after a small job, never).
        self._verify_next = time.monotonic()
        self.verify_thread: threading.Thread | None = None
        # bound now, so the series exist (at 0) before the first shape finishes: an alert or a
        # dashboard then reads 0, not "no data"
        self._per_shape = metrics.BATCHES_PER_SHAPE.labels(model, owner)
        self._thrashing = metrics.THRASHING_SHAPES.labels(model, owner)
        # The disk tier (conductor/tier/spill.py): the lease holder feeds store segments into the lanes
        # as they drain, more often than it sweeps (a worker must not wait on its feeder).
        self.feeder = Feeder(conductor, conductor.tier.store, model) if conductor.tier is not None else None
        self.feed_interval_s = 0.05
        self._held_until = 0.0
        # Until when an idle beat (lua/idle_beat.lua, workers/idle.py) that took or renewed the lease
        # stands for lease.lua: an idle holder then sends one call where it sent two.
        self._told_until = 0.0
        self._feed_next = 0.0
        # Intake tasks whose process died (a killed conductor submit or serve) whose file this host
        # can read are resumed here too: a fleet may run without serve (conductor/intake/intake_resume.py).
        self.intake = Resumer(conductor, owner)
        # Told of each failure first; True means it was reported there (the worker's outage line),
        # so no line of its own here.
        self.on_error: Callable[[BaseException], bool] | None = None
        # A refused feed is a stall with one line each way and a gauge (workers/feed_stall.py); the
        # room it needs is made at most this often (conductor/tier/room.py).
        self.stall = FeedStall(model, owner)
        self.room_interval_s = 0.2
        self._room_next = 0.0
        self.room_moved = 0  # result records moved to the store to make room

    @classmethod
    def for_worker(cls, conductor: Conductor, model: str, owner: str, heartbeat_ttl_s: float) -> Maintenance:
        """A worker's (or host agent's) maintenance: the lease outlives a few heartbeats, and a live
        consumer's entry counts as lost only well past its heartbeat's TTL."""
        ttl_ms = int(heartbeat_ttl_s * 1000)
        return cls(conductor, model, owner, lease_ms=max(1000, min(5000, 3 * ttl_ms)),
                   stale_idle_ms=max(3000, 10 * ttl_ms))

    def due_in(self) -> float:
        """Seconds until the next tick does its work (an idle worker blocks at most this long):
        the next sweep, or the next feed while this worker holds the lease and segments wait."""
        now = time.monotonic()
        due = self._next
        if self.feeder is not None and self.feeder.more and now < self._held_until:
            due = min(due, self._feed_next)
        return max(0.0, due - now)

    def told(self, held: bool, in_flight: int = -1, ms: int = 0) -> None:
        """What an idle beat found of the lease: held (taken or renewed in that call, for ``ms``, the
        part's ``lease_ms`` if 0) or not; and, when it read them (``in_flight`` >= 0), the batches
        pending: none stands for the sweep's XPENDING as the lease answer stands for its lease call;
        some end a quiet spell at once. A quiet shard's sweep comes with its turn's beat (this call)."""
        now = time.monotonic()
        ms = ms or self.lease_ms
        if held:
            self._stretched = ms > self.lease_ms
            self._told_until = now + ms / 2000
            self._held_until = max(self._held_until, now + ms / 2000)
            if in_flight == 0:
                self._told_idle_until = self._told_until
                if self.quiet and self.shard:
                    self._next = now
            elif in_flight > 0:
                self.in_flight = in_flight
                self._told_idle_until = 0.0
                self.wake(now)  # a batch in flight: swept at its period from now (a dead consumer's)
        else:
            self._told_until = self._held_until = self._told_idle_until = 0.0
            self._stretched = False

    def wake(self, now: float | None = None) -> None:
        """Quiet no longer (work came, or the worker leaves its idle wait): the next sweep within a
        period, as while busy; and a lease an idle beat stretched past ``lease_ms`` renewed to it at the
        next tick, so that it hands over within ``lease_ms`` if this worker dies busy."""
        now = time.monotonic() if now is None else now
        if self.quiet:
            self.quiet = False
            self._next = min(self._next, now + self.interval_s)
            self._verify_next = min(self._verify_next, now + self.verify_interval_s)
            # what a busy spell leaves to the full sweep (its trim, finished shapes, dead consumers)
            # within its period, not a quiet one's
            self._full_next = min(self._full_next, now + FULL_SWEEP_S)
        if self._stretched:  # renewed at the next tick, a period from now: the claim comes first
            self._stretched = False
            self._told_until = self._told_idle_until = 0.0
            self._held_until = min(self._held_until, now + self.lease_ms / 2000)
            self._next = min(self._next, now + self.interval_s)

    def put_off(self) -> None:
        """The next sweep (its lease call first) a period from now: a worker a ring woke claims first."""
        self._next = max(self._next, time.monotonic() + self.interval_s)

    def holds(self) -> bool:
        """Whether this worker held the lease at its last take or renewal, well inside its TTL."""
        return time.monotonic() < self._held_until

    def lease_alive(self) -> bool:
        """Whether the lease this worker last took or renewed has not run out yet (``holds`` says so
        for its first half only): an idle worker keeps ticking such a part, and the tick renews it."""
        return time.monotonic() < self._held_until + self.lease_ms / 2000

    def tick(self, may_quiet: bool = False, early_s: float = 0.0) -> dict[str, int] | None:
        """One sweep when due (or due within ``early_s``: the idle wait sweeps with a beat); ``may_quiet``:
        the idle wait's tick, which may leave the part quiet (``quiet_s``) when it finds nothing to watch."""
        now = time.monotonic()
        self._feed(now)
        if now + early_s < self._next:
            return None
        self._next = now + self.interval_s
        try:
            if now >= self._told_until and not calls.lease(self.keys.maint_lease, self.owner,
                                                           self.lease_ms).run(self.c.scripts):
                self._held_until = 0.0
                return None
            # fed only well inside the lease: another worker may take it once it lapses
            self._held_until = max(self._held_until, now + self.lease_ms / 2000)
            # Live consumers lose only entries idle past stale_idle_ms: their heartbeat extends
            # every lease it knows of, so such an entry is one whose claim reply never arrived
            # (Redis died between running the script and answering).
            # A dead consumer holding no batch costs nothing but its registration: forgotten every
            # FULL_SWEEP_S, so an idle fleet's holder reads one XPENDING a second, not a heartbeat
            # per worker (issue 36).
            full = now >= self._full_next
            if full:
                self._full_next = now + (QUIET_FULL_SWEEP_S if self.quiet else FULL_SWEEP_S)
            if not full and now < self._told_idle_until:
                # an idle beat just read the pending count: none (lua/idle_beat.lua), no XPENDING more
                res = {"consumers": 0, "batches": 0, "items": 0, "dead": 0, "in_flight": 0}
            else:
                res = self.c.reclaim_dead(self.model, min_idle_ms=self.stale_idle_ms, pending_only=not full)
            self.in_flight = res.get("in_flight", 0)
            if res["batches"]:
                log.info(json.dumps({"event": "reclaimed", "model": self.model, **res}))
            # A worker's part with nothing in flight (issue 36: S + 1 lease holders each swept every
            # part; an unsharded model's one): its finished shapes and its stream's trim wait for the
            # next full sweep (FULL_SWEEP_S), so an idle holder reads one XPENDING (and renews its
            # lease) a sweep. Both only defer (the alarm reads on from its cursor, the trim takes what was
            # acknowledged meanwhile).
            if not (self.defer_when_idle and not full and not self.in_flight):
                self._thrash_alarm()
                trim_model(self.c, self.model)
            self._drift_check()
            if not self.shard:
                # Jobs past their completion window end expired (issue 17): one sweeper at a time among
                # the lease holders of every model and the serve replicas (conductor/jobs/job_state.py);
                # and intake tasks resumed (cdr:intake:tasks). Both are global: a shard's tick leaves
                # them to its model's own part, which every worker of the model ticks too. The earliest
                # deadline is read (one command, as "is one due" was): a quiet part wakes for it.
                self.next_deadline = first_deadline(self.c)
                if self.next_deadline is not None and self.next_deadline <= time.time():
                    expire_due_leased(self.c, self.owner)
                self.intake.tick()
            self._settle(now, may_quiet)
            if self.feeder is not None:  # the disk tier: results past the window go to the store,
                offload_model(self.c, self.feeder.store, self.model)
                # and answered ids to their packed form (conductor/tier/compact_ids.py): a job of any
                # size then drains through a Redis of fixed size
                compact_model(self.c, self.model)
            return res
        except RIDE_OUT_OR_STORE as e:  # a Redis failure, a paused model (Paused), memory full
            # (QueueFull), a store that does not answer
            if self.on_error is None or not self.on_error(e):
                log.warning(json.dumps({"event": "maintenance_failed", "model": self.model, "error": str(e)}))
            return None

    def _settle(self, now: float, may_quiet: bool) -> None:
        """Quiet or not after a sweep: quiet when the idle wait ticked it and nothing here needs watching
        within ``quiet_s`` (a batch in flight, an intake task open, segments to feed, a deadline):
        its next sweep ``quiet_s`` away, or at the earliest deadline."""
        quiet = may_quiet and self.quiet_s > 0 and self.defer_when_idle and not self.in_flight \
            and not (self.feeder is not None and self.feeder.more)
        due = float("inf")
        if quiet and not self.shard:
            quiet = not self.intake.open
            if self.next_deadline is not None:
                due = self.next_deadline - time.time()
                quiet = quiet and due > self.interval_s
        self.quiet = quiet
        if quiet:
            # a shard's next sweep comes with its turn's beat (``told``), a round of the shards away
            self._next = float("inf") if self.shard else now + min(self.quiet_s, due)

    def _feed(self, now: float) -> None:
        if self.feeder is None or now >= self._held_until or now < self._feed_next:
            return
        self._feed_next = now + self.feed_interval_s
        try:
            if now >= self._room_next and memory_pressure(self.c.r):
                self._make_room(now)  # near maxmemory: make room before anything is refused
            self.feeder.feed()
        except RIDE_OUT_OR_STORE as e:
            told = self.on_error is not None and self.on_error(e)  # a Redis outage: the link's line
            self.stall.failed(e, say=not told)
            if isinstance(e, QueueFull):  # over maxmemory: results move to the store, then feed again
                try:
                    self._make_room(now)
                except RIDE_OUT_OR_STORE:
                    pass  # the stall stays on (its gauge, its alert): the next feed tries again
            return
        self.stall.ok()

    def _make_room(self, now: float) -> None:
        if now < self._room_next or self.feeder is None:
            return
        self._room_next = now + self.room_interval_s
        moved = make_room(self.c, self.feeder.store, self.model)
        self.room_moved += moved
        if moved:
            log.info(json.dumps({"event": "room_made", "model": self.model, "results_moved": moved}))

    def _drift_check(self) -> None:
        if self.verify_interval_s <= 0 or (self.verify_thread and self.verify_thread.is_alive()):
            return
        now = time.monotonic()
        if now < self._verify_next:
            return
        # quiet (nothing ran since the last check, nothing runs): seldom; a wake brings it back in
        self._verify_next = now + self.verify_interval_s * (QUIET_VERIFY_FACTOR if self.quiet else 1)
        self.verify_thread = threading.Thread(target=self._verify, name="verify", daemon=True)
        self.verify_thread.start()

    def _verify(self) -> None:
        from conductor.verify import watch_drift
        metrics.WORKER.set(self.owner)  # this thread's own context: the drift series carry its worker
        try:
            watch_drift(self.c.r, self.model)
        except Exception as e:  # noqa: BLE001 - a check must never take its worker down
            log.warning(json.dumps({"event": "verify_failed", "model": self.model, "error": repr(e)}))

    def _thrash_alarm(self) -> None:
        """A shape that finished in under ``thrash_batches`` batches, more than twice the batches its
        items could fill (``could``: its tokens in reference budgets), did not pay for its switch: it
        ran in small pieces. A small shape run in the few batches it could fill is not thrashing."""
        if self._finished_cursor == "$":
            last: list[StreamEntry] = self.c.r.xrevrange(self.keys.finished, count=1)  # type: ignore[assignment]
            self._finished_cursor = last[0][0].decode() if last else "0-0"
            return
        rows: list[StreamEntry] = self.c.r.xrange(  # type: ignore[assignment]  # bytes replies
            self.keys.finished, min=f"({self._finished_cursor}", count=1000)
        for eid, f in rows:
            self._finished_cursor = eid.decode()
            batches = int(f[b"batches"])
            self.batches_per_shape.append(batches)
            self._per_shape.observe(batches)
            could = int(f.get(b"could", 0))  # 0: an entry written before claim.lua counted it
            if batches < self.thrash_batches and batches > 2 * could:
                self._thrashing.inc()
                log.critical(json.dumps({"event": "shape_thrashing", "model": self.model,
                                         "instance": f[b"inst"].decode(), "batches": batches,
                                         "could_fill": could, "threshold": self.thrash_batches}))
