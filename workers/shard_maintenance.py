"""A worker of a sharded model (issue 36; conductor/redis_contract/shards.py) on its model's shards:
registered and beating on each (a shard's reclaim sweep judges its consumers by the shard's own
heartbeat keys), handing back and taking back on each, and one maintenance per shard, whose lease
holder sweeps that shard's dead consumers.

On an unsharded model every call here does nothing beyond what the worker does on the model itself
(workers/worker_start.py), and ``for_worker`` is the model's one Maintenance."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from conductor.client import Conductor, shard_migrate
from conductor.client.shard_claims import ShardClaims
from conductor.errors import ConductorError
from conductor.jobs.shard_fair import ShardFair
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.records import Batch, Contract

from .held import event
from .maintenance import FULL_SWEEP_S, Maintenance
from .transient import RIDE_OUT

FORGET_EVERY_S = 10.0
# what forgetting a lapsed worker rides out: a Redis failure, a paused model, a script's refusal (the full
# sweeps forget it later)
FORGET_RIDES_OUT: tuple[type[BaseException], ...] = (*RIDE_OUT, ConductorError)
# The tenants' service over the shards combined this often while the model's own part is quiet and
# nothing was seen to run since the last combine (``_fair``).
QUIET_FAIR_S = 600.0
SHARD_SWEEP_S = 2.5


class ShardMembers:
    """What the worker does on the model's keys, done on each other shard too."""

    def __init__(self, c: Conductor, shards: ShardClaims) -> None:
        self.c = c
        self.shards = shards
        self._registered: set[str] = set()
        self._reg: tuple[str, str, Contract, int] | None = None

    def others(self) -> list[str]:
        return [n for n in self.shards.names() if n != self.shards.model]

    def register(self, worker: str, shown: str, contract: Contract, ttl_ms: int) -> None:
        self._reg = (worker, shown, contract, ttl_ms)
        self._registered.clear()
        if self.others():
            self.c.ensure_shards(self.shards.model)
        self._join_new()

    def _join_new(self) -> None:
        """Register on shards not yet joined (a change of the count adds some while the worker runs)."""
        if self._reg is None:
            return
        worker, shown, contract, ttl_ms = self._reg
        for name in self.others():
            if name in self._registered:
                continue
            self.c.ensure_model(name)
            calls.register(K.ModelKeys(name), worker, shown, msgspec_replace(contract, name), int(time.time() * 1000),
                           ttl_ms).run(self.c.scripts)
            self._registered.add(name)

    def rejoin(self, name: str) -> bool:
        """Register on shard ``name`` again (an idle beat found the registration gone: a sweep there
        took the worker for dead, or the shard's keys were emptied); False when ``name`` is no longer
        a shard of the model (an old layout forgotten), which then needs no registration."""
        if name not in self.others():
            return False
        self._registered.discard(name)
        self._join_new()
        return True

    def beat(self, worker: str, ttl_ms: int, held: Iterable[Batch], busy_ms: int) -> None:
        others = self.others()
        if not others:
            return
        self._join_new()
        by_shard: dict[str, list[str]] = {}
        for b in held:
            by_shard.setdefault(b.model, []).append(b.batch_id)
        now = int(time.time() * 1000)
        for name in others:
            calls.heartbeat(K.ModelKeys(name), worker, now, ttl_ms, by_shard.get(name, []), busy_ms).run(self.c.scripts)

    def take_back(self, worker: str) -> None:
        """What an earlier run under this name left pending on each shard, handed back now."""
        for name in self.others():
            mk = K.ModelKeys(name)
            if self.c.r.exists(mk.batches) and self.c.r.xpending_range(mk.batches, K.GROUP, "-", "+", 1,
                                                                        consumername=worker):
                res = self.c.reclaim_consumer(name, worker, force=True)
                event("took_back", worker=worker, shard=name, batches=res["batches"], items=res["items"])

    def reclaim(self, worker: str) -> dict[str, int]:
        """This worker's pending batches on the model and every shard, to the reclaimed queues."""
        total = self.c.reclaim_consumer(self.shards.model, worker, force=True)
        for name in self.others():
            got = self.c.reclaim_consumer(name, worker, force=True)
            for k in ("batches", "items", "dead"):
                total[k] += got[k]
        return total

    def deregister(self, worker: str) -> None:
        for name in self.others():
            mk = K.ModelKeys(name)
            pipe = self.c.r.pipeline(transaction=False)
            for key in (mk.workers, mk.affinity, mk.warming, mk.busy):
                pipe.hdel(key, worker)
            pipe.delete(mk.heartbeat(worker))
            pipe.execute()
            if not self.c.r.xpending_range(mk.batches, K.GROUP, "-", "+", 1, consumername=worker):
                self.c.r.xgroup_delconsumer(mk.batches, K.GROUP, worker)


def msgspec_replace(contract: Contract, model: str) -> Contract:
    return Contract(model=model, max_batch_size=contract.max_batch_size, max_batch_tokens=contract.max_batch_tokens,
                    max_input_len=contract.max_input_len)


class ShardMaintenance:
    """One Maintenance per shard (and the model's own), ticked together: each shard's lease holder
    sweeps that shard's dead consumers, feeds, trims and checks its counters."""

    def __init__(self, c: Conductor, shards: ShardClaims, owner: str, heartbeat_ttl_s: float) -> None:
        self.c, self.shards, self.owner, self.ttl_s = c, shards, owner, heartbeat_ttl_s
        self.parts: dict[str, Maintenance] = {}
        self._forget_next = 0.0
        self.fair = ShardFair(c.r)
        self._fair_next = 0.0
        # something ran since the last combine (a batch in flight seen, the holding mark, a wake): the
        # model's next tick combines, quiet or not
        self._fair_due = True
        self.on_error: Callable[[BaseException], bool] | None = None
        self.quiet_s = 0.0  # each part's (Maintenance.quiet_s): set by the idle wait, workers/idle.py
        self._refresh()

    def quiet_after(self, seconds: float) -> None:
        """Let a part the idle wait ticks go quiet, swept every ``seconds`` while nothing is to watch."""
        self.quiet_s = seconds
        for m in self.parts.values():
            m.quiet_s = seconds

    def _refresh(self) -> None:
        for name in dict.fromkeys([self.shards.model, *self.shards.names()]):
            if name not in self.parts:
                m = Maintenance.for_worker(self.c, name, self.owner, self.ttl_s)
                # with nothing in flight, a part (the whole model when unsharded) leaves its trim and
                # thrash alarm to the full sweep: an idle holder's tick is its lease and one XPENDING more
                m.defer_when_idle = True
                if name != self.shards.model:
                    # a shard's sweep less often than the model's: each costs a lease, a reclaim
                    # sweep and a trim, and a dead worker's batches wait for its heartbeat's TTL anyway
                    m.interval_s = SHARD_SWEEP_S
                    m.shard = True
                m.on_error = self.on_error
                m.quiet_s = self.quiet_s
                self.parts[name] = m

    def due_in(self) -> float:
        """The latest of the parts' next duties, none later than a sweep period: an idle worker wakes
        once for all of them (their periods drift apart by the time each tick takes), not once each."""
        return min(max(m.due_in() for m in self.parts.values()), SHARD_SWEEP_S)

    # What an idle worker's wait (workers/idle.py) asks of its maintenance. Its beats take or renew
    # each part's lease (lua/idle_beat.lua on the model, and on each shard in turn), so it ticks only
    # the parts whose lease it holds: a tick of any other would be a lease.lua call of its own.
    def lease_ms(self, name: str | None = None) -> int:
        part = self.parts.get(name or self.shards.model)
        return (part or self.parts[self.shards.model]).lease_ms

    def told(self, held: bool, name: str | None = None, in_flight: int = -1, ms: int = 0) -> None:
        name = name or self.shards.model
        if name not in self.parts and held:
            self._refresh()  # a shard new to this worker whose lease its beat took: its part sweeps there
        part = self.parts.get(name)
        if part is not None:  # else a shard the layout dropped meanwhile: no part to tell
            part.told(held, in_flight, ms)
        if in_flight > 0:
            self._fair_due = True

    def wake(self) -> None:
        """Every quiet part back to its period: work came (a ring), or the worker leaves its idle wait."""
        self._fair_due = True
        for m in self.parts.values():
            m.wake()

    def forget_lapsed(self, workers: Iterable[str], shards: Iterable[str]) -> None:
        """Workers whose idle beat on the model's keys lapsed (the model's lease holder's beat is told,
        lua/idle_beat.lua): their heartbeats on ``shards`` deleted, one command a shard. An idle worker's
        shard heartbeat lives a round of the shards (workers/idle.py), and what a shard's scripts count
        (claim.lua's fleet size, lib_workers.lua) cannot read the model's: left to run out, a worker
        killed while idle would count there a round and a grace after its last turn (19.5 s at S = 3),
        where it now leaves every shard about a TTL after its last beat. Then each is forgotten on the
        model and every shard (registration, consumer; lua/reclaim.lua, as a full sweep forgets a dead
        consumer holding nothing), so that a quiet part's full sweep (``QUIET_FULL_SWEEP_S``) need not
        look for them. A hint only: a failure leaves them to run out and to the full sweeps."""
        dead = list(workers)
        names = list(shards)
        try:
            for name in names:
                mk = K.ModelKeys(name)
                self.c.r.delete(*[mk.heartbeat(w) for w in dead])
            for name in (self.shards.model, *names):
                for w in dead:
                    self.c.reclaim_consumer(name, w)
        except FORGET_RIDES_OUT as e:
            if self.on_error is None or not self.on_error(e):
                event("lapsed_failed", model=self.shards.model, error=str(e))
            return
        event("lapsed", model=self.shards.model, workers=dead)

    def wake_shards(self) -> None:
        """Every quiet shard's part back to its period: the model's holding mark says a worker holds
        batches on a shard (lua/heartbeat.lua), which may die with them."""
        self._fair_due = True
        for name, m in self.parts.items():
            if name != self.shards.model:
                m.wake()

    def put_off(self) -> None:
        """Every part whose lease this worker does not hold: its next sweep (a lease call first) a
        period from now, so that a worker a ring woke claims first."""
        for m in self.parts.values():
            if not m.lease_alive():
                m.put_off()

    def holds(self) -> bool:
        """Whether this worker holds any part's lease (the model's or a shard's)."""
        return any(m.lease_alive() for m in self.parts.values())

    def held_due_in(self) -> float:
        """Seconds until the next duty of a part whose lease this worker holds (inf: none held), a quiet
        part's left out: the idle wait sweeps those with a beat (workers/idle.py)."""
        return min((m.due_in() for m in self.parts.values() if m.lease_alive() and not m.quiet),
                   default=float("inf"))

    def tick(self, held_only: bool = False, early_s: float = 0.0) -> dict[str, int] | None:
        """Each part's tick; ``held_only``: only the parts whose lease this worker holds (an idle wait),
        each swept when due within ``early_s``."""
        # an idle wait's tick reads no layout (a change of the count rings the model's doorbell with its
        # first submit, and the tick after the wake reads it; a beat that takes a new shard's lease
        # adds its part, ``told``); nor, while the model's own part is quiet, moves or forgets old shards
        if not held_only:
            self._refresh()
        own = self.parts.get(self.shards.model)
        still = held_only and own is not None and own.quiet
        out: dict[str, int] | None = None
        for name, m in list(self.parts.items()):
            if held_only and not m.lease_alive():
                continue
            m.on_error = self.on_error
            got = m.tick(may_quiet=held_only, early_s=early_s)
            if got is not None:
                out = {k: (out or {}).get(k, 0) + v for k, v in got.items()}
                if name == self.shards.model and len(self.parts) > 1:
                    if not still:
                        self._migrate()
                        self._forget_drained()
                    self._fair()
                elif name != self.shards.model and got.get("batches"):
                    self._ring(name)
        return out

    def _ring(self, name: str) -> None:
        """A shard's sweep put a dead worker's batches back: ring the model's doorbell, on which idle
        workers block (a shard's own doorbell has none waiting on it)."""
        try:
            self.c.ring_model_bell([name])
        except RIDE_OUT as e:  # a hint only: the shard's next beats find the work anyway
            if self.on_error is None or not self.on_error(e):
                event("bell_failed", model=self.shards.model, error=str(e))

    def _migrate(self) -> None:
        """Waiting shapes of an old layout to their new shards, one bounded step a tick (shard_migrate.py).
        Nothing to move without an old layout: the layout as cached (LAYOUT_TTL_S) says so, not a read
        of it a tick; a change of the count is seen that much later."""
        try:
            if not self.c.layout(self.shards.model).old:
                return
            moved = shard_migrate.step(self.c, self.shards.model, self.owner)
        except RIDE_OUT as e:
            if self.on_error is None or not self.on_error(e):
                event("shard_migrate_failed", model=self.shards.model, error=str(e))
            return
        except ConductorError as e:  # an id the new shard holds with other content: the list waits, said each time
            event("shard_migrate_failed", model=self.shards.model, error=str(e))
            return
        if moved:
            event("shard_migrated", model=self.shards.model, items=moved)

    def _fair(self) -> None:
        """Tenants' service over the shards combined (conductor/jobs/shard_fair.py), by the model's lease
        holder: each tick while a shard's last sweep saw a batch in flight, else every ``FULL_SWEEP_S``
        (a shard's service grows only with its claims; a top-up skipped is taken at the next one, as
        each sums the growth since the last). While the model's own part is quiet, at its next tick
        after something ran (a batch in flight seen, the model's holding mark, which a worker claiming
        on a shard sets, a wake), else every ``QUIET_FAIR_S`` (it was every minute: an HGETALL a part, 0.07
        commands a second at S = 3)."""
        now = time.monotonic()
        if now < self._fair_next and not self._fair_due and not any(m.in_flight for m in self.parts.values()):
            return
        own = self.parts.get(self.shards.model)
        quiet = own is not None and own.quiet
        self._fair_due = False
        self._fair_next = now + (QUIET_FAIR_S if quiet else FULL_SWEEP_S)
        try:
            self.fair.sync(self.shards.names())
        except RIDE_OUT as e:
            self._fair_due = True  # at the next tick
            if self.on_error is None or not self.on_error(e):
                event("shard_fair_failed", model=self.shards.model, error=str(e))

    def _forget_drained(self) -> None:
        """The model's lease holder forgets an old layout once its shards are empty (workers stop
        claiming and beating there)."""
        now = time.monotonic()
        if now < self._forget_next:
            return
        self._forget_next = now + FORGET_EVERY_S
        try:
            gone = self.c.forget_drained(self.shards.model)
        except RIDE_OUT as e:
            if self.on_error is None or not self.on_error(e):
                event("shards_forget_failed", model=self.shards.model, error=str(e))
            return
        if gone:
            event("old_shards_drained", model=self.shards.model, counts=gone)
            self.parts = {n: m for n, m in self.parts.items() if n in {self.shards.model, *self.shards.names()}}


def for_worker(c: Conductor, shards: ShardClaims, owner: str, heartbeat_ttl_s: float) -> ShardMaintenance:
    """The worker's maintenance: the model's own Maintenance alone while it is not sharded (today's),
    one more per shard from the moment it is (a live change of the count included)."""
    return ShardMaintenance(c, shards, owner, heartbeat_ttl_s)
