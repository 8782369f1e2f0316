"""An idle worker's wait (issue 36): one blocking read on the model's doorbell and one
lua/idle_beat.lua call a beat (on a sharded model, one on the model's keys and one on a shard's in
turn), nothing else.

A worker whose claim answered 'idle' (nothing waits) used to renew the maintenance lease every
second, claim again every second, BLPOP between the two and beat its heartbeat every third of its
TTL: about 4 commands a second, so 1,000 idle workers took almost two Redis cores. Here it blocks
on the doorbell until a ring (new work: it claims at once) or its next beat, half the heartbeat
TTL (5 s at the default 10 s). The beat renews the heartbeat and the busy time, takes or renews
the maintenance lease, and says whether a claim could find work: work that comes without a ring (a
dead worker's batches put back, items short of a full batch once intake goes quiet) is claimed at
the next beat. The heartbeat thread, which beats a third of the TTL after the last heartbeat,
is put off past the next beat and sends nothing.

Half the TTL, not a third as the heartbeat thread beats: an idle worker leases no batch, so a beat
late past the TTL costs nothing but a moment of looking dead (the thread steps in if it is later
than ``GRACE``); a worker that holds batches (a host agent whose GPU processes run while its claim
found nothing) leaves its heartbeat to the thread, which extends their leases.

A sharded model (conductor/redis_contract/shards.py): the worker is registered on the model's keys
and every shard's, and one BLPOP cannot span their slots. So it blocks on the model's own doorbell,
which a submit or a seal on any shard rings (conductor/client/shard_route.py ``ring_model_bell``),
beats the model's own keys every period (its heartbeat lives the TTL's own, as unsharded) and one
shard a period in turn: each shard heartbeat lives a round of the shards (S periods) and ``GRACE``
more, each registration stays, each turn takes or renews that shard's maintenance lease, and work
that waits there without a ring is claimed at that turn (a shard's sweep that puts batches back
rings the model's doorbell: workers/shard_maintenance.py). A worker counts as alive on a shard while
its heartbeat there and its heartbeat on the model's keys both live (conductor/client/fleet.py
``live_workers``; a shard's sweep, conductor/client/writeback.py, deletes the shard heartbeat of
one whose model heartbeat is gone, then reclaims as for any dead consumer): a worker killed while
idle lapses a TTL after its last beat (10 s), not a round (it was 26 s at S = 3, 46 s at S = 6); one
that holds batches has every heartbeat beaten by the heartbeat thread, the TTL's own, as before.
Three commands a period whatever S is (a BLPOP and two beats: 0.6 a second at the default TTL; 0.4
unsharded); the first period after a busy spell beats every shard once (the heartbeat thread's
beats left each a TTL to live, not a round). What the shards' scripts read (claim.lua's fleet size
and affinities, lua/lib_workers.lua) cannot read the model's slot, so the model's lease holder deletes
them: each idle beat of the model's keys indexes when the heartbeat it set runs out (``M:beats``), and
the holder's beat is told who ran out with no heartbeat left (lua/idle_beat.lua), whose shard
heartbeats it deletes (ShardMaintenance.forget_lapsed): a worker killed while idle leaves each shard's
fleet size a TTL and at most a period after its last beat (it counted there until its shard heartbeat
ran out, a round and ``GRACE`` after its last turn: 19.5 s at S = 3, 39 s at S = 6), for no command
more while nobody dies. A busy holder leaves it to each shard's full sweep (``FULL_SWEEP_S``). Work
that comes without any ring (a dead letter retried) waits for its shard's turn, a round at most, not a
period.

The lease holder (issue 36's last gap: it sent 3.8 to 9.7 commands a second) sweeps a part whose
lease it holds with its beats while the part is quiet (workers/maintenance.py ``quiet_s``: nothing in
flight there, no intake task open, no job's deadline within a second): the beat of the part's keys
takes or renews its lease until that keyspace's next beat (a round of the shards on a shard) and
tells its holder the batches in flight there, which stand for the sweep's lease.lua call and
XPENDING; the model's own part then reads the earliest deadline and the intake tasks (global keys,
two commands) every ``QUIET_BEATS`` beats, and a quiet shard is swept with its turn. An idle holder
then sends 0.6 commands a second unsharded, and about 0.8 holding every part of a sharded model (a
BLPOP and the two beats a period, the two reads every second period), plus each part's full sweep
and drift check every hour (about 11 to 19 commands with 8 consumers, and 20: 0.05 a second at S = 3,
0.09 at S = 6; bench/broker/holder_sweep.py --duties). A part leaves its quiet at once
when its beat tells of a batch in flight, a ring wakes the worker, or (a shard's) the model's holding
mark lives: a worker that holds batches on a shard, or is about to claim, sets it with its heartbeat
on the model's keys for the TTL
(lua/heartbeat.lua), so a batch claimed on a quiet shard by a worker that then dies comes back within
a period and a sweep, not at that shard's next turn. The next deadline is a quiet part's wake-up
too. What a quiet holder leaves later than a busy one: a new job's deadline earlier than every known
one, or a new intake task whose owner died, is seen at its next quiet sweep (10 s at the default TTL;
serve replicas read the deadlines every 5 s too); a holder that dies idle hands its lease over after
a period and ``GRACE`` (6.5 s, not 5; a round and ``GRACE`` on a quiet shard: 19.5 s at S = 3); the
tenants' service over the
shards is combined at the model's next quiet sweep after something ran (a batch in flight seen, the
holding mark, a wake), else every 10 minutes, while the model's own part is quiet. An idle worker ticks only
the parts (the model, each shard) whose lease it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls

from .doorbell import Doorbell, ride_out
from .worker_start import WorkerStart

if TYPE_CHECKING:  # imported where the loop starts, as workers/worker.py does
    from .shard_maintenance import ShardMaintenance as Maintenance

# An idle beat every this share of the heartbeat TTL; the heartbeat thread steps in only when the
# next one is late by GRACE x that period (a holder's sweep that runs long, say).
BEAT_SHARE = 0.5
GRACE = 0.3
# A BLPOP is cut at this many seconds: redis-py reads the reply under the connection's socket
# timeout (10 s), which a longer block would pass.
MAX_BLOCK_S = 5.0
# A lease holder's quiet part (nothing in flight, no intake task open, no deadline near:
# workers/maintenance.py ``quiet_s``) is swept every this many beats, at a beat.
QUIET_BEATS = 2
# A held part's sweep due within this share of a period after a beat runs with it, not after a BLPOP of
# its own.
ALIGN = 0.75


class IdleBeat:
    def __init__(self, worker: WorkerStart, maint: Maintenance, bell: Doorbell) -> None:
        self.w = worker
        self.maint = maint
        self.bell = bell
        self.ttl_ms = max(1, int(worker.opts.heartbeat_ttl_s * 1000))
        self.period_s = BEAT_SHARE * worker.opts.heartbeat_ttl_s
        self._busy_sent: int | None = None
        self._beat_at = 0.0  # monotonic time of the last beat sent
        # a sharded model: until when each shard's heartbeat lives, as far as this worker knows (the
        # heartbeat thread's beats shorten it to the TTL), and until when the thread is put off
        self._lives: dict[str, float] = {}
        self._thread_off_until = 0.0
        self.beats = 0  # tests, metrics
        self.shard_beats = 0
        maint.quiet_after(QUIET_BEATS * self.period_s)

    def _ttl_ms(self, round_of: int) -> int:
        """A beat's heartbeat TTL: until the turn after the next, a round of ``round_of`` keyspaces away
        (the TTL's own while the worker leases batches: a reclaim must not wait a round for a dead
        worker's)."""
        if self.w.leased_ids():
            return self.ttl_ms
        return max(self.ttl_ms, int(1000 * round_of * self.period_s * (1 + GRACE)))

    def _lease_ms(self, lease_ms: int, round_of: int) -> int:
        """A beat's maintenance lease: until the keyspace's next beat, a round of ``round_of`` away, and
        ``GRACE`` more, so that a quiet holder (workers/maintenance.py ``quiet_s``) keeps it with its
        beats alone; ``lease_ms`` at least. A holder that dies idle hands over that much later; one that
        wakes renews it to ``lease_ms`` at its next tick (Maintenance.wake)."""
        return max(lease_ms, int(1000 * round_of * self.period_s * (1 + GRACE)))

    def beat(self, round_of: int = 1, sharded: bool = False) -> calls.IdleBeat:
        """The model's own keys: heartbeat, busy time, its maintenance lease, whether work waits; and
        for its holder the batches in flight there and, ``sharded``, the holding mark: some worker holds
        batches on a shard (or is about to claim), so the quiet shards whose lease this worker holds are
        swept from now, not at their turns."""
        busy = int(self.w.metrics.busy_s * 1000)
        ttl = self._ttl_ms(round_of)
        lease = self._lease_ms(self.maint.lease_ms(), 1)
        sent = time.monotonic()
        got = calls.idle_beat(
            self.w.keys,
            self.w.name,
            int(time.time() * 1000),
            ttl,
            lease,
            None if busy == self._busy_sent else busy,
            in_flight=True,
            holding=sharded,
        ).run(self.w.c.scripts)
        self._busy_sent = busy
        self._lives[self.w.shards.model] = sent + ttl / 1000
        self.beats += 1
        self.maint.told(got.held, in_flight=got.in_flight, ms=lease)
        if got.holding:
            self.maint.wake_shards()
        if not got.registered:
            self.w._rejoin_needed.set()  # the worker's loop joins again (workers/outage.py)
        return got

    def beat_shard(self, name: str, round_of: int) -> calls.IdleBeat:
        """Shard ``name``'s turn: its heartbeat, its lease, whether work waits there. The busy time is
        left as the heartbeat thread last wrote it there (it does not change while idle)."""
        ttl = self._ttl_ms(round_of)
        lease = self._lease_ms(self.maint.lease_ms(name), round_of)
        sent = time.monotonic()
        got = calls.idle_beat(
            K.ModelKeys(name), self.w.name, int(time.time() * 1000), ttl, lease, None, in_flight=True
        ).run(self.w.c.scripts)
        self._lives[name] = sent + ttl / 1000
        self.shard_beats += 1
        self.maint.told(got.held, name, got.in_flight, lease)
        return got

    def _turns(self, spaces: list[str], now: float, thread_beat: bool) -> list[str]:
        """The shards to beat this period: the one whose heartbeat runs out first (a round, in turn),
        and any other that would run out before the next period. After the heartbeat thread has
        beaten (a busy spell), each heartbeat lives only the TTL: every keyspace is beaten within the
        period, once, before the turns spread them over the round again."""
        if thread_beat:  # it beats every third of the TTL: each heartbeat lives half the TTL at least
            floor = now + self.ttl_ms / 2000
            for name in spaces:
                self._lives[name] = min(self._lives.get(name, floor), floor)
        order = sorted(spaces, key=lambda n: self._lives.get(n, 0.0))
        if self.w.leased_ids():  # the thread keeps these heartbeats: a turn for the lease and the work
            return order[:1]
        horizon = now + self.period_s * (1 + GRACE)
        return [n for n in order if self._lives.get(n, 0.0) < horizon] or order[:1]

    def _beat_round(self, shards: list[str], now: float) -> bool:
        """This period's beats: the model's own keys, then the shards' turns; True when work waits on one
        of them or the worker must join again. The model's heartbeat lives the TTL's own, as unsharded:
        a shard's readers judge the worker by it too (alive there: both heartbeats), so a worker killed
        while idle lapses everywhere a TTL after its last beat, however long its shard heartbeats live.
        A shard whose registration is gone is joined again, or, an old layout forgotten, dropped from
        ``shards``."""
        thread_beat = now >= self._thread_off_until  # read before this period puts it off again
        self._beat_at = now
        self._thread_off_until = 0.0
        if not self.w.leased_ids():  # else the heartbeat thread's beat must still extend their leases
            self.w.hb_due = max(self.w.hb_due, now + self.period_s * (1 + GRACE))
            self._thread_off_until = self.w.hb_due
        got = self.beat(1, sharded=bool(shards))
        if got.lapsed and shards:  # the holder's: dead idle workers out of every shard's fleet now
            self.maint.forget_lapsed(got.lapsed, shards)
        if got.waits or not got.registered:
            return True
        if not shards:
            return False
        for name in self._turns(shards, now, thread_beat):
            on = self.beat_shard(name, len(shards))
            if not on.registered:
                if self.w.members.rejoin(name):  # a sweep there took it for dead: join, and beat again
                    on = self.beat_shard(name, len(shards))  # (registering set the TTL's own)
                else:
                    shards.remove(name)
            if on.waits:
                return True
        return False

    def wait(
        self,
        last_claim: str,
        idle_exit_s: float | None,
        idle_since: float,
        on_error: Callable[[BaseException], object] | None = None,
    ) -> bool | None:
        """After a claim that found nothing at all ('idle'): block until a ring (True), work a beat or
        the sweep found, the idle exit or a stop (False), or a transient Redis error (None:
        ``on_error`` hears of it, the caller backs off). After any other answer, the doorbell's
        wait bounded by the next timed duty (Doorbell.wait_idle)."""
        if last_claim != "idle":
            return self.bell.wait_idle(self.maint.due_in(), idle_exit_s, idle_since, last_claim, on_error)
        # the shards as the claim just saw them (a change of the count rings the model's doorbell
        # with its first submit, and the claim then reads the new layout)
        shards = self.w.members.others()
        return ride_out(lambda: self._wait(shards, idle_exit_s, idle_since), on_error)

    def _unstretch(self, shards: list[str]) -> None:
        """Work is here: on a sharded model, every heartbeat back to the TTL's own before the claim (one
        heartbeat call a keyspace, once a wake-up), so that a worker that dies holding a batch it is
        about to claim is reclaimed a TTL after, not a round of the keyspaces after."""
        if not shards:
            return  # unsharded, a beat's heartbeat lives the TTL's own already
        self.w._beat(claiming=True)  # and the holding mark: the shards' lease holders sweep from now
        now = time.monotonic()
        self.w.hb_due = now + self.w.opts.heartbeat_ttl_s / 3
        for name in self._lives:
            self._lives[name] = min(self._lives[name], now + self.ttl_ms / 1000)

    def _wait(self, shards: list[str], idle_exit_s: float | None, idle_since: float) -> bool:
        try:
            return self._wait_on(shards, idle_exit_s, idle_since)
        finally:
            self.maint.wake()  # a claim follows: the quiet parts' sweeps back to their periods

    def _wait_on(self, shards: list[str], idle_exit_s: float | None, idle_since: float) -> bool:
        while not self.w.stopping.is_set():
            now = time.monotonic()
            if idle_exit_s is not None and now - idle_since > idle_exit_s:
                return False
            beat_due = now >= self._beat_at + self.period_s
            if beat_due and self._beat_round(shards, now):
                self._unstretch(shards)
                return False
            # a quiet part is swept at a beat, the first whose next is within ALIGN of a period of its due
            # time (its due time is no wake-up of its own: held_due_in leaves it out)
            early = ALIGN * self.period_s if beat_due else 0.0
            if self.maint.holds() and (beat_due or self.maint.held_due_in() <= 0):
                res = self.maint.tick(held_only=True, early_s=early)
                if res and res.get("batches"):
                    return False  # the sweep put a dead worker's batches back: claim them
            limit = min(self._beat_at + self.period_s - time.monotonic(), self.maint.held_due_in())
            if idle_exit_s is not None:
                limit = min(limit, idle_exit_s - (time.monotonic() - idle_since) + 0.01)
            if self.bell.wait(min(MAX_BLOCK_S, max(0.0, limit)), "idle"):
                self.maint.put_off()  # the leases it does not hold are its beats' business; new work first
                self._unstretch(shards)
                return True
        return False
