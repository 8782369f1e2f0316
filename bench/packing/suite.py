"""Issue 6: the conductor against its peers and the offline oracle, same workload, same engine.

    .venv/bin/python bench/packing/suite.py            # full mode (standard workload), rewrites RESULTS.md
    .venv/bin/python bench/packing/suite.py --quick    # under 2 minutes; CI smoke size

Systems, all with ``conductor.workers.engines.sim.SimEngine`` (a SIMULATED GPU: throughput figures are
in simulated GPU seconds, ``SimEngine.counters.sim_seconds``, not wall time), the same
contract (batch size, batch tokens, input length) and the same admission latch:

* ``rq``: RQ 2.12.0 as a FIFO job queue (enqueue_many, JSONSerializer); each worker pops job
  ids in order (LPOP) and fetches them (Job.fetch_many), batching whatever comes next up to
  the token budget; what does not fit opens the worker's next batch.
* ``stream``: one plain Redis stream with a consumer group, XREADGROUP in order, the same
  FIFO token-budget batching.
* ``oracle``: every item known in advance (``bench/common/oracle.py``, which documents the rule): each
  shape sorted by length and cut greedily into full batches under the contract, shapes balanced
  across the workers by estimated work (longest first, a deep shape split into length ranges
  over several workers), each worker running its own list shape after shape; its next batch's
  graph is prewarmed (free in the sim). Here it ignores arrival.
* ``conductor``: Conductor.submit, then the real ``conductor.workers.worker.Worker`` loop (claim,
  engine, complete) against claim.lua and complete.lua; results read back and checked:
  every id exactly once.

All workers of a system run in this process, scheduled in simulated time: the worker whose
simulated clock is lowest takes the next turn (a turn: one decode step, then a pull when the
latch admits), so the fleet behaves as parallel GPUs. A worker that finds nothing to do waits
``IDLE_QUANTUM`` simulated seconds (while items are still arriving, with ``idle_max_s`` set, it
backs off, doubling up to ``idle_max_s``, as ``Worker.run`` does up to ``poll_max_s``), except a
conductor worker whose claim answered 'idle' (``SuiteConfig.wake`` "bell", as ``Worker.run``'s
default): it blocks on the model's doorbell as workers/idle.py does, woken by a ring (a submit,
a seal, or a woken worker that found work passing the ring on) or at its next beat, ``BEAT_S``
later, and makes no claim meanwhile. FIFO peers
hand the engine batches that mix shapes: the engine admits them as one sub-batch per shape, every
item padded to the batch's longest.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402

from bench.common.oracle import Item, OracleClock, OracleSource, Plan, sim_work  # noqa: E402
from bench.common.oracle import plan as oracle_plan  # noqa: E402
from bench.common.report import command_line, git_rev, machine, median, now_utc, pct, publish, table  # noqa: E402
from bench.common.workload import Workload, WorkloadSpec, generate  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract.config import parse_value  # noqa: E402
from conductor.redis_contract.packing import fits, pad8  # noqa: E402
from conductor.redis_contract.records import (  # noqa: E402
    Batch,
    BatchItem,
    PreparedItem,  # noqa: E402
    result_decoder,
)
from conductor.workers.engines.sim import SimEngine  # noqa: E402
from conductor.workers.idle import BEAT_SHARE  # noqa: E402
from conductor.workers.latch import AdmissionLatch  # noqa: E402
from conductor.workers.worker import Worker, WorkerOptions  # noqa: E402

IDLE_QUANTUM = 0.002  # simulated seconds an idle worker waits before it looks again
# An idle conductor worker's beat period in simulated seconds: workers/idle.py's BEAT_SHARE of the
# default heartbeat TTL (WorkerOptions.heartbeat_ttl_s, 10 s), not of the suite's own TTL (an hour, so
# that no simulated worker looks dead on the wall clock).
BEAT_S = BEAT_SHARE * WorkerOptions.heartbeat_ttl_s
SYSTEMS = ("rq", "stream", "oracle", "conductor", "conductor-tuned")
CONDUCTORS = ("conductor", "conductor-tuned")
# Tighter lanes than the defaults (conductor/redis_contract/config.py: lane_floor 0, lane_thr_min 0.003): less padding,
# at the price of more lanes per shape.
TUNED_CFG: dict[str, Any] = {"lane_floor": 0, "lane_thr_min": 0.001}


@dataclass
class SuiteConfig:
    workers: int = 4
    max_batch_size: int = 64
    max_batch_tokens: int = 65536
    max_input_len: int = 8192
    high_water: int = 1024
    low_water: int = 768
    max_wall_s: float = 600.0
    # An idle worker's wait doubles up to this while items are still arriving (trickle), as
    # Worker.run backs off up to WorkerOptions.poll_max_s; IDLE_QUANTUM: no backoff.
    idle_max_s: float = IDLE_QUANTUM
    # A conductor worker whose claim answered 'idle': "bell" blocks on the doorbell until a ring or its
    # next beat (Worker.run's default, WorkerOptions.wake); "poll" looks again after IDLE_QUANTUM.
    wake: str = "bell"
    conductor_cfg: dict[str, Any] = field(default_factory=dict)  # cfg fields set before submitting
    # Fleet changes during a conductor run (bench/fleet/fleet.py): (fraction of items finished, worker index,
    # 'join' | 'drain' | 'kill'); a worker with a 'join' event is not there before it. late_fleet: the
    # workers register after the backlog is submitted (backlog, then fleet).
    events: tuple[tuple[float, int, str], ...] = ()
    late_fleet: bool = False


class RecordingSim(SimEngine):
    """The sim engine, plus a trace of (simulated time, sequences finished) and a log of what it
    admitted, in order: (batch id, shape, padded length, item ids) (for bench/common/static_cost.py)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.trace: list[tuple[float, int]] = []
        self.log: list[tuple[str, str, int, list[str]]] = []
        self.instances: list[str] = []  # "shape:epoch" of each admission, beside log (bench/fleet/fleet.py)

    def admit(self, batch: Batch, items: list[BatchItem]) -> list:
        limit = self.contract.max_input_len
        self.log.append((batch.batch_id, batch.shape, batch.padded_len,
                         [it.id for it in items if it.input_tokens <= limit]))
        self.instances.append(f"{batch.shape}:{batch.epoch}")
        return super().admit(batch, items)

    def step(self) -> list:
        done = super().step()
        if done:
            self.trace.append((self.counters.sim_seconds, len(done)))
        return done


@dataclass
class Record:
    """What one system did, in the terms of the report."""

    system: str
    items: int = 0
    submit_s: float = 0.0
    mem_per_item: float = float("nan")
    redis_cpu_us_per_item: float = float("nan")
    claim_us: list[float] = field(default_factory=list)
    claim_calls: int = 0  # every pull, also those that got nothing
    # one row per batch: items, padded length, actual tokens, items asked for, shapes in it
    batches: list[tuple[int, int, int, int, tuple[str, ...]]] = field(default_factory=list)
    engines: list[RecordingSim] = field(default_factory=list)
    makespan: float = 0.0
    wall_s: float = 0.0
    complete: str = "n/a"
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ peers
class FifoSource:
    """FIFO token-budget batching over a fetch function; the item that does not fit is kept,
    in order, for this worker's next batch."""

    def __init__(self, fetch: Callable[[int], list[Item]], budget: int) -> None:
        self.fetch = fetch
        self.budget = budget
        self.carry: deque[Item] = deque()

    def next_batch(self, size: int) -> list[Item]:
        need = size - len(self.carry)
        if need > 0:
            self.carry.extend(self.fetch(need))
        out: list[Item] = []
        maxlen = 0
        while self.carry and fits(len(out), maxlen, self.carry[0].tok, size, self.budget):
            it = self.carry.popleft()
            out.append(it)
            maxlen = max(maxlen, it.tok)
        return out


class PeerWorker:
    """The worker loop of workers/worker.py (step, then pull when the latch admits) over a peer."""

    def __init__(self, idx: int, engine: RecordingSim, source: Any, cfg: SuiteConfig, rec: Record,
                 prefixes: dict[str, tuple[str, ...]]) -> None:
        self.idx = idx
        self.engine = engine
        self.source = source
        self.cfg = cfg
        self.rec = rec
        self.prefixes = prefixes
        self.latch = AdmissionLatch(cfg.high_water, cfg.low_water)
        self.finished = 0
        self.seq = 0

    def turn(self) -> bool:
        busy = False
        if self.engine.active():
            self.finished += len(self.engine.step())
            busy = True
        if self.latch.admits(self.engine.active()):
            rooms = [x for x in (self.latch.room(self.engine.active()), self.engine.room()) if x is not None]
            size = min([self.cfg.max_batch_size, *rooms])
            if size > 0:
                t = time.perf_counter_ns()
                items = self.source.next_batch(size)
                self.rec.claim_calls += 1
                if items:
                    self.rec.claim_us.append((time.perf_counter_ns() - t) / 1000)
                    self._admit(items, size)
                    busy = True
        return busy

    def _admit(self, items: list[Item], asked: int) -> None:
        plen = pad8(max(it.tok for it in items))
        self.seq += 1
        groups: dict[str, list[Item]] = {}
        for it in items:
            groups.setdefault(it.sig, []).append(it)
        self.rec.batches.append((len(items), plen, sum(it.tok for it in items), asked, tuple(groups)))
        for sig, its in groups.items():
            b = Batch(model="peer", batch_id=f"{self.idx}-{self.seq}", shape=sig, epoch=0, lane=0, padded_len=plen,
                      max_tokens=max(it.mt for it in its), claimed_at=0,
                      items=[BatchItem(id=it.id, job="j", input_tokens=it.tok, max_tokens=it.mt, prompt="")
                             for it in its], prefix=list(self.prefixes[sig]))
            self.finished += len(self.engine.admit(b, b.items))


# ------------------------------------------------------------------------------------ driver
class BellWait:
    """The doorbell wait of workers/idle.py in simulated time, for the drive: a conductor worker whose
    claim answered 'idle' (nothing waits at all) takes one entry off the model's doorbell if there is
    one (rung: it claims at once, and passes the ring on when that claim gets a batch, as Worker.run
    does), else blocks until a ring or its next beat, ``BEAT_S`` later. Rings come from submit.lua and
    seal.lua (the drive looks after each release of items) and from passed-on rings; a blocked worker
    is woken by them longest-blocked first, as BLPOP serves its clients. Work that comes without a ring
    (a killed worker's batches put back) waits for the beat, as it does for a real worker. After any
    other answer ('wait', 'gate', ...) the worker looks again after the drive's quantum, as before: the
    real wait then is bounded by the model's quiet time and the maintenance tick, which this does not
    model."""

    def __init__(self, workers: list[Any]) -> None:
        self.inner = [getattr(w, "w", w) for w in workers]  # Member.w, or a Worker driven directly
        self.blocked: dict[int, float] = {}  # worker -> simulated time it blocked at
        self.rung: set[int] = set()  # woken by a ring: pass it on if the next claim gets a batch
        self.claims: dict[int, int] = {}

    def _bell(self, i: int) -> str | None:
        w = self.inner[i]
        return w.keys.doorbell if isinstance(w, Worker) else None

    def blocks(self, i: int) -> bool:
        """After an idle turn of worker ``i``: True when it now blocks on the bell (False: rung, or it
        would not wait on the bell: it claims again after the quantum)."""
        w = self.inner[i]
        if self._bell(i) is None or w.last_claim != "idle" or w.retry or w.engine.room() == 0:
            return False
        if w.c.r.lpop(w.keys.doorbell) is not None:
            self.rung.add(i)
            self.claims[i] = w.batches_claimed
            return False
        self.rung.discard(i)
        return True

    def after_turn(self, i: int) -> None:
        """A rung worker that got a batch rings once more (Doorbell.pass_on): the next blocked one wakes."""
        if i in self.rung:
            w = self.inner[i]
            if w.batches_claimed > self.claims.get(i, w.batches_claimed):
                self.rung.discard(i)
                w.c.r.lpush(w.keys.doorbell, 1)
                w.c.r.ltrim(w.keys.doorbell, 0, 15)

    def wake(self, idle: list[float], engines: list[RecordingSim], now: float) -> None:
        """Wake the blocked workers the doorbell's entries ring for, at simulated time ``now``: their
        clocks come back from their next beat."""
        for i in self.woken():
            idle[i] = max(0.0, now - engines[i].counters.sim_seconds)

    def woken(self) -> list[int]:
        """The blocked workers a ring wakes now: one per doorbell entry, longest blocked first."""
        out: list[int] = []
        for i in sorted(self.blocked, key=self.blocked.__getitem__):
            bell = self._bell(i)
            if bell is None or self.inner[i].c.r.lpop(bell) is None:
                break
            out.append(i)
            self.rung.add(i)
            self.claims[i] = self.inner[i].batches_claimed
        for i in out:
            del self.blocked[i]
        return out


def _sim_clocks(workers: list[Any], engines: list[RecordingSim], idle: list[float]) -> None:
    """Each conductor worker's claim pacing (workers/pacing.py BusyIdle) runs on its simulated clock."""
    for i, wk in enumerate(workers):
        inner = getattr(wk, "w", wk)
        if isinstance(inner, Worker):
            inner.clock = lambda i=i: engines[i].counters.sim_seconds + idle[i]


def drive(workers: list[Any], engines: list[RecordingSim], total: int, finished: Callable[[], int],
          release: Releaser | OracleClock | None, max_wall_s: float, nap: bool = True,
          idle_max: float = IDLE_QUANTUM, wake: str = "poll") -> tuple[float, float]:
    """Run turns in simulated-time order until ``total`` sequences finished: (makespan, wall).

    With arrivals (``release``) the simulated clock is paced to the wall clock while items are
    still to arrive: the broker's own timers (quiet intake, lane quiet time, aging) run on
    Redis's clock, so simulated time must not run ahead of it while items trickle in. ``nap``:
    sleep a little when every worker is idle (a broker may be waiting on wall-clock time).
    ``idle_max``: while items are still to arrive, an idle worker's wait doubles up to this.
    ``wake``: "bell", a conductor worker whose claim answered 'idle' waits on the doorbell
    (BellWait); "poll", every idle worker looks again after the quantum.
    """
    n = len(workers)
    idle = [0.0] * n
    quantum = [IDLE_QUANTUM] * n
    last_finish = [0.0] * n
    bells = BellWait(workers) if wake == "bell" else None
    _sim_clocks(workers, engines, idle)
    t0 = time.monotonic()
    idle_run = 0
    while finished() < total:
        clocks = [engines[i].counters.sim_seconds + idle[i] for i in range(n)]
        w = min(range(n), key=clocks.__getitem__)
        if release is not None:
            while release.pending and (ahead := clocks[w] - (time.monotonic() - t0)) > 0:
                time.sleep(min(ahead, 0.01))
            release(clocks[w])
        if bells is not None and bells.blocked:
            if release is not None:  # a submit or the seal may have rung
                bells.wake(idle, engines, clocks[w])
                clocks = [engines[i].counters.sim_seconds + idle[i] for i in range(n)]
                w = min(range(n), key=clocks.__getitem__)
            bells.blocked.pop(w, None)  # its beat (or a ring): it looks again
        before = engines[w].counters.finished
        if workers[w].turn():
            idle_run = 0
            quantum[w] = IDLE_QUANTUM
            if engines[w].counters.finished != before:
                last_finish[w] = engines[w].counters.sim_seconds + idle[w]
            if bells is not None and bells.rung:
                bells.after_turn(w)
                bells.wake(idle, engines, clocks[w])
        elif bells is not None and bells.blocks(w):
            bells.blocked[w] = clocks[w]
            idle[w] += BEAT_S
        else:
            idle[w] += quantum[w]
            quantum[w] = min(2 * quantum[w], idle_max) if release is not None and release.pending else IDLE_QUANTUM
            idle_run += 1
            if nap and idle_run >= 4 * n:
                time.sleep(0.002)  # the broker may be waiting on wall-clock quiet time
        if time.monotonic() - t0 > max_wall_s:
            raise RuntimeError(f"gave up after {max_wall_s:.0f} s wall: {finished()} of {total} finished")
    return max(last_finish), time.monotonic() - t0


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _engines(cfg: SuiteConfig, model: str) -> list[RecordingSim]:
    # The engine these benchmarks model runs about high_water sequences at once (the oracle's sim cost
    # model assumes as many decode together), claimed in batches of max_batch_size: its max_num_seqs.
    return [RecordingSim(model, max_batch_size=cfg.max_batch_size, max_batch_tokens=cfg.max_batch_tokens,
                         max_input_len=cfg.max_input_len, time_scale=0.0, max_num_seqs=cfg.high_water)
            for _ in range(cfg.workers)]


class Releaser:
    """Submits items whose simulated arrival time has come (trickle); everything at once for a backlog."""

    def __init__(self, wl: Workload, submit: Callable[[list[PreparedItem]], None]) -> None:
        self.items = wl.items
        self.arrival = wl.arrival_s
        self.submit = submit
        self.next = 0
        self.spent = 0.0

    @property
    def pending(self) -> bool:
        return self.next < len(self.items)

    def __call__(self, now: float) -> None:
        if self.next >= len(self.items) or self.arrival[self.next] > now:
            return
        end = self.next
        while end < len(self.items) and self.arrival[end] <= now + 0.05:
            end += 1
        t = time.perf_counter()
        self.submit(self.items[self.next:end])
        self.spent += time.perf_counter() - t
        self.next = end


def run_peer(system: str, r: redis.Redis, wl: Workload, cfg: SuiteConfig) -> Record:  # noqa: C901 - one branch per peer system, side by side
    if system == "oracle":
        return run_oracle(wl, cfg)
    rec = Record(system, items=len(wl.items))
    prefixes = {s.sig: s.prefix for s in wl.shapes}
    engines = _engines(cfg, wl.spec.model)
    rec.engines = engines
    r.flushall()
    mem0, cpu0 = int(r.info("memory")["used_memory"]), _redis_cpu(r)
    backlog = wl.spec.arrival == "backlog"

    if system == "rq":
        from rq import Queue
        from rq.job import Job
        from rq.serializers import JSONSerializer
        q = Queue("bench", connection=r, serializer=JSONSerializer)

        def submit(its: list[PreparedItem]) -> None:
            for s in range(0, len(its), 1000):
                q.enqueue_many([Queue.prepare_data("bench.rq_fifo.run_item",
                                                   args=(it.id, it.sig, it.input_tokens, it.max_tokens))
                                for it in its[s:s + 1000]])

        def make_fetch(_i: int) -> Callable[[int], list[Item]]:
            def fetch(n: int) -> list[Item]:
                ids = r.lpop(q.key, n) or []
                jobs = Job.fetch_many([i.decode() if isinstance(i, bytes) else i for i in ids], connection=r,
                                      serializer=JSONSerializer)
                return [Item(*j.args) for j in jobs if j is not None]
            return fetch
    elif system == "stream":
        key = "plain:{bench}:items"

        def submit(its: list[PreparedItem]) -> None:
            for s in range(0, len(its), 1000):
                pipe = r.pipeline(transaction=False)
                for it in its[s:s + 1000]:
                    pipe.xadd(key, {"id": it.id, "sig": it.sig, "tok": it.input_tokens, "mt": it.max_tokens,
                                    "d": it.body})
                pipe.execute()
        r.xgroup_create(key, "g", id="0", mkstream=True)

        def make_fetch(i: int) -> Callable[[int], list[Item]]:
            def fetch(n: int) -> list[Item]:
                reply = r.xreadgroup("g", f"w{i}", {key: ">"}, count=n)
                entries = _entries(reply)
                if entries:
                    pipe = r.pipeline(transaction=False)
                    ids = [e[0] for e in entries]
                    pipe.xack(key, "g", *ids)
                    pipe.xdel(key, *ids)
                    pipe.execute()
                return [Item(f[b"id"].decode(), f[b"sig"].decode(), int(f[b"tok"]), int(f[b"mt"]))
                        for _, f in entries]
            return fetch
    else:
        raise ValueError(system)

    workers = [PeerWorker(i, engines[i], FifoSource(make_fetch(i), cfg.max_batch_tokens), cfg, rec, prefixes)
               for i in range(cfg.workers)]
    rel = Releaser(wl, submit)
    release = None
    if backlog:
        rel(0.0)
        rec.submit_s = rel.spent
        rec.mem_per_item = (int(r.info("memory")["used_memory"]) - mem0) / len(wl.items)
    else:
        release = rel
    rec.makespan, rec.wall_s = drive(workers, engines, len(wl.items), lambda: sum(w.finished for w in workers),
                                     release, cfg.max_wall_s, idle_max=cfg.idle_max_s)
    if not backlog:
        rec.submit_s = rel.spent
    rec.redis_cpu_us_per_item = (_redis_cpu(r) - cpu0) * 1e6 / len(wl.items)
    return rec


def oracle_prefixes(wl: Workload) -> dict[str, int]:
    return {s.sig: s.prefix_tokens for s in wl.shapes}


def run_oracle(wl: Workload, cfg: SuiteConfig, plan: Plan | None = None, arrival: bool = False) -> Record:
    """The offline oracle (bench/common/oracle.py) under the sim: each worker pulls from its own planned
    list. ``plan``: default, planned for the sim's cost; ``arrival``: a batch waits for its items
    to arrive (otherwise arrival is ignored)."""
    rec = Record("oracle", items=len(wl.items))
    prefixes = {s.sig: s.prefix for s in wl.shapes}
    engines = _engines(cfg, wl.spec.model)
    rec.engines = engines
    if plan is None:
        plan = oracle_plan(wl.items, oracle_prefixes(wl), cfg.workers, cfg.max_batch_size, cfg.max_batch_tokens,
                           sim_work(high_water=cfg.high_water), wl.arrival_s if arrival else None)
    clock = OracleClock() if arrival else None
    rec.notes.append("offline: no Redis, no submit; " + (f"arrival respected, {plan.windows} window(s)"
                                                         if arrival else "arrival ignored"))
    workers = [PeerWorker(i, engines[i], OracleSource(plan.workers[i], engines[i], clock), cfg, rec, prefixes)
               for i in range(cfg.workers)]
    rec.makespan, rec.wall_s = drive(workers, engines, len(wl.items), lambda: sum(w.finished for w in workers),
                                     clock, cfg.max_wall_s, nap=False, idle_max=cfg.idle_max_s)
    return rec


def _entries(reply: Any) -> list:
    if not reply:
        return []
    if isinstance(reply, dict):
        (v,) = reply.values()
        return v[0] if v and isinstance(v[0], list) and len(v) == 1 and isinstance(v[0][0], list) else v
    return reply[0][1]


class Member:
    """A conductor worker of the fleet as the drive sees it: there from the start (or from its
    'join' event, or registering at its first turn when the fleet comes after the backlog), and
    leaving at its 'drain' event (stops pulling, finishes what it holds, deregisters: SIGTERM) or
    its 'kill' event (its engine's sequences lost, its heartbeat gone and its batches reclaimed at
    once, as the lease holder's sweep does once the heartbeat expires: SIGKILL)."""

    def __init__(self, w: Worker, idx: int, events: Sequence[tuple[float, int, str]], finished: Callable[[], int],
                 total: int) -> None:
        self.w = w
        self.at = {kind: frac for frac, i, kind in events if i == idx}
        self.finished = finished
        self.total = total
        self.state = "waiting"

    def start(self) -> None:
        if self.state == "waiting":
            self.w.register()
            self.state = "live"

    def _due(self, kind: str) -> bool:
        return kind in self.at and self.finished() >= self.at[kind] * self.total

    def turn(self) -> bool:
        if self.state == "waiting":
            if "join" in self.at and not self._due("join"):
                return False
            self.start()
        if self.state == "live" and self._due("kill"):
            self._kill()
        if self.state == "live" and self._due("drain"):
            self.w.stopping.set()
            self.state = "draining"
        if self.state in ("dead", "gone"):
            return False
        busy = self.w.turn()
        if self.state == "draining" and not self.w.engine.active() and not self.w.retry and not self.w.inflight:
            self.w.deregister()
            self.state = "gone"
        return busy

    def _kill(self) -> None:
        w = self.w
        # results finished but not written die with it: they run again elsewhere, and count there
        w.finished -= sum(len(res) for _, res, _ in w.retry) + sum(len(e.results) for e in w.inflight.values())
        w.engine.close()
        w.inflight.clear()
        w.retry.clear()
        w.c.r.delete(w.keys.heartbeat(w.name))
        w.c.reclaim_consumer(w.contract.model, w.name, force=True)
        self.state = "dead"

    def finish(self) -> None:
        if self.state == "live":
            while self.w.retry or self.w.inflight:
                self.w.turn()
            self.w.deregister()


def run_conductor(r: redis.Redis, url: str, wl: Workload, cfg: SuiteConfig, job: str = "suite",
                  name: str = "conductor", model_cfg: dict[str, Any] | None = None) -> Record:
    rec = Record(name, items=len(wl.items))
    engines = _engines(cfg, wl.spec.model)
    rec.engines = engines
    r.flushall()
    r.script_flush()
    producer = Conductor(connect(url))
    producer.ensure_model(wl.spec.model)
    model_cfg = cfg.conductor_cfg if model_cfg is None else model_cfg
    if model_cfg:
        producer.set_config(wl.spec.model, model_cfg)
        rec.notes.append(", ".join(f"{k}={v}" for k, v in model_cfg.items()))
    mem0, cpu0 = int(r.info("memory")["used_memory"]), _redis_cpu(r)
    workers = []
    for i, eng in enumerate(engines):
        c = Conductor(connect(url))
        w = Worker(c, eng, WorkerOptions(name=f"suite-w{i}", high_water=cfg.high_water, low_water=cfg.low_water,
                                         heartbeat_ttl_s=3600.0))
        _instrument(c, rec, i)
        workers.append(w)
    finished = lambda: sum(w.finished for w in workers)  # noqa: E731
    members = [Member(w, i, cfg.events, finished, len(wl.items)) for i, w in enumerate(workers)]
    if not cfg.late_fleet:
        for m in members:
            m.start()
    backlog = wl.spec.arrival == "backlog"
    # A backlog is one file: its producer seals it (seal.lua), as `conductor submit` does.
    rel = Releaser(wl, lambda its: producer.submit(its, job, seal=backlog or its[-1] is wl.items[-1]))
    if backlog:
        rel(0.0)
        rec.submit_s = rel.spent
        rec.mem_per_item = (int(r.info("memory")["used_memory"]) - mem0) / len(wl.items)
    rec.makespan, rec.wall_s = drive(members, engines, len(wl.items), finished,
                                     None if backlog else rel, cfg.max_wall_s, idle_max=cfg.idle_max_s,
                                     wake=cfg.wake)
    if not backlog:
        rec.submit_s = rel.spent
    for m in members:  # results of the last batches are written on the turn after they finish
        m.finish()
    rec.redis_cpu_us_per_item = (_redis_cpu(r) - cpu0) * 1e6 / len(wl.items)
    rec.complete = check_complete(producer, job, wl)
    return rec


def _instrument(c: Conductor, rec: Record, idx: int) -> None:
    """Time each claim round trip (with decoding) and note each batch the worker gets."""
    inner = c.claim

    def claim(contract: Any, consumer: str) -> tuple[Batch | None, str]:
        t = time.perf_counter_ns()
        batch, why = inner(contract, consumer)
        rec.claim_calls += 1
        if batch is not None:
            rec.claim_us.append((time.perf_counter_ns() - t) / 1000)
            rec.batches.append((len(batch.items), batch.padded_len, batch.actual_tokens, contract.max_batch_size,
                                (batch.shape,)))
        return batch, why
    c.claim = claim  # type: ignore[method-assign]


def check_complete(c: Conductor, job: str, wl: Workload) -> str:
    """'ok' when every submitted id has exactly one result, else what is wrong."""
    seen = Counter(result_decoder.decode(raw).id for raw in c.results(job))
    want = {it.id for it in wl.items}
    missing = len(want - set(seen))
    doubled = sum(1 for v in seen.values() if v > 1)
    extra = len(set(seen) - want)
    if missing or doubled or extra:
        return f"INCOMPLETE: {missing} missing, {doubled} doubled, {extra} unknown"
    return "ok: every id exactly once"


# ------------------------------------------------------------------------------------ figures
def batch_fill(n: int, plen: int, asked: int, cfg: SuiteConfig) -> float:
    """How full a batch is against what its worker asked for: the token budget or the item count
    (the latch may ask for fewer than max_batch_size items when few slots are free)."""
    return min(1.0, max(n * plen / cfg.max_batch_tokens, n / asked))


def batch_fills(rec: Record, cfg: SuiteConfig) -> list[float]:
    return [batch_fill(n, plen, asked, cfg) for n, plen, _a, asked, _s in rec.batches]


def figures(rec: Record, cfg: SuiteConfig) -> dict[str, float]:
    eng = rec.engines
    fin = sum(e.counters.finished for e in eng)
    out_tok = sum(e.counters.output_tokens for e in eng)
    actual = sum(e.counters.actual_tokens for e in eng)
    padding = sum(e.counters.padding_tokens for e in eng)
    hit = sum(e.counters.prefix_hit_tokens for e in eng)
    miss = sum(e.counters.prefix_miss_tokens for e in eng)
    fills = batch_fills(rec, cfg)
    per_shape = Counter(s for *_x, sigs in rec.batches for s in sigs)
    return {
        "submit_items_s": rec.items / rec.submit_s if rec.submit_s else float("nan"),
        "seq_s": fin / rec.makespan if rec.makespan else float("nan"),
        "tok_s": (actual + out_tok) / rec.makespan if rec.makespan else float("nan"),
        "makespan": rec.makespan,
        "wall_s": rec.wall_s,
        "padding_waste": padding / (padding + actual) if actual else float("nan"),
        "fill_p50": pct(fills, 50), "fill_p90": pct(fills, 90), "fill_p99": pct(fills, 99),
        "asked_below_max": sum(1 for b in rec.batches if b[3] < cfg.max_batch_size) / max(1, len(rec.batches)),
        "contract_fill_p50": pct([batch_fill(n, plen, cfg.max_batch_size, cfg) for n, plen, *_ in rec.batches], 50),
        "prefix_hit": hit / (hit + miss) if hit + miss else float("nan"),
        "switches_per_worker": sum(e.counters.shape_switches for e in eng) / len(eng),
        "batches": len(rec.batches),
        "batches_per_shape_p50": median(list(per_shape.values())),
        "graph_rebuilds": sum(e.counters.graph_rebuilds for e in eng),
        "claim_p50": pct(rec.claim_us, 50), "claim_p99": pct(rec.claim_us, 99),
        "redis_cpu_us_item": rec.redis_cpu_us_per_item,
        "mem_per_item": rec.mem_per_item,
        "finished": fin,
    }


ROWS: list[tuple[str, str, str, bool]] = [
    # key, label, format, higher is better
    ("submit_items_s", "submit items/s (wall)", "{:,.0f}", True),
    ("seq_s", "finished sequences/s (SIMULATED GPU time)", "{:,.1f}", True),
    ("tok_s", "tokens/s in+out (SIMULATED GPU time)", "{:,.0f}", True),
    ("makespan", "makespan, simulated s (fleet)", "{:,.1f}", False),
    ("padding_waste", "padding waste (padded-actual)/padded", "{:.3%}", False),
    ("fill_p50", "batch fill p50", "{:.1%}", True),
    ("fill_p90", "batch fill p90", "{:.1%}", True),
    ("fill_p99", "batch fill p99", "{:.1%}", True),
    ("asked_below_max", "batches asked below max batch size (latch)", "{:.1%}", False),
    ("contract_fill_p50", "batch fill p50 against the full contract", "{:.1%}", True),
    ("prefix_hit", "prefix-cache hit (tokens)", "{:.2%}", True),
    ("switches_per_worker", "shape switches per worker", "{:,.1f}", False),
    ("batches", "batches", "{:,.0f}", False),
    ("batches_per_shape_p50", "batches per shape p50", "{:,.0f}", False),
    ("graph_rebuilds", "sim graph builds", "{:,.0f}", False),
    ("claim_p50", "claim round trip p50 us", "{:,.0f}", False),
    ("claim_p99", "claim round trip p99 us", "{:,.0f}", False),
    ("redis_cpu_us_item", "Redis CPU us per item (whole run)", "{:,.1f}", False),
    ("mem_per_item", "Redis memory bytes per queued item", "{:,.0f}", False),
    ("wall_s", "wall seconds of the run", "{:,.1f}", False),
]


def _fmt(fmt: str, v: float) -> str:
    return "n/a" if v != v else fmt.format(v)  # NaN check


def report(args: argparse.Namespace, mach: str, spec: WorkloadSpec, cfg: SuiteConfig, recs: dict[str, Record],
           figs: dict[str, dict[str, float]], plots: list[str]) -> str:
    systems = [s for s in SYSTEMS if s in figs]
    peers = [s for s in ("rq", "stream") if s in figs]
    cond = [c for c in CONDUCTORS if c in figs]
    header = ["figure", *systems] + [f"{c} / {ref}" for c in cond for ref in ("oracle", "best peer")]
    rows = []
    for key, label, fmt, higher in ROWS:
        row = [label] + [_fmt(fmt, figs[s][key]) for s in systems]
        o = figs.get("oracle", {}).get(key, float("nan"))
        pv = [figs[p][key] for p in peers if figs[p][key] == figs[p][key]]
        best = (max(pv) if higher else min(pv)) if pv else float("nan")
        for cn in cond:
            c = figs[cn][key]
            row.append(f"{c / o:.2f}x" if o and o == o and c == c else "n/a")
            row.append(f"{c / best:.2f}x" if best and best == best and c == c else "n/a")
        rows.append(row)
    o = figs.get("oracle", {})
    fifo = max((figs[p]["seq_s"] for p in peers), default=float("nan"))

    def goal(name: str, ok: bool, value: str) -> str:
        return f"- {name}: {value} **{'met' if ok else 'MISSED'}**"
    goals = []
    for cn in cond:
        f = figs[cn]
        if not o:
            break
        goals += [f"- *{cn}*" + (f" ({recs[cn].notes[0]})" if recs[cn].notes else " (default config)") + ":"]
        goals += ["  " + g for g in [
            goal("padding waste <= 0.42 % and <= 1.1x the oracle's", f["padding_waste"] <= 0.0042
                 and f["padding_waste"] <= 1.1 * o["padding_waste"],
                 f"{f['padding_waste']:.3%} (oracle {o['padding_waste']:.3%})"),
            goal("fill >= 99 % at p50 and p90", f["fill_p50"] >= 0.99 and f["fill_p90"] >= 0.99,
                 f"p50 {f['fill_p50']:.1%}, p90 {f['fill_p90']:.1%}"),
            goal("sim prefix-cache hit >= 99.9 %", f["prefix_hit"] >= 0.999, f"{f['prefix_hit']:.2%}"),
            goal("finished sequences/s >= 3x the FIFO peers", f["seq_s"] >= 3 * fifo,
                 f"{f['seq_s'] / fifo:.2f}x the better FIFO peer"),
            goal("finished sequences/s >= 0.95x the oracle", f["seq_s"] >= 0.95 * o["seq_s"],
                 f"{f['seq_s'] / o['seq_s']:.2f}x"),
        ]]
    lines = [
        f"## Suite: conductor vs peers vs oracle (issue 6, {'quick' if args.quick else 'full'} mode, "
        f"{spec.arrival})",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {mach}  ",
        f"Date: {now_utc()}, commit {git_rev()}  ",
        f"Workload: {spec.items:,} items, {spec.shapes} shapes (Zipf s={spec.zipf_s}), prefixes "
        f"{spec.prefix_min}..{spec.prefix_max} tokens, suffix lognormal(mu=ln {round(2.718281828 ** spec.suffix_mu)}, "
        f"sigma={spec.suffix_sigma}), output limits {list(spec.output_limits)} per shape, arrival {spec.arrival}"
        f"{f' at {spec.rate:,.0f} items per simulated s' if spec.arrival == 'trickle' else ''}, seed {spec.seed}.  ",
        f"Contract for every system: {cfg.workers} workers, max batch {cfg.max_batch_size} items, "
        f"{cfg.max_batch_tokens:,} tokens (memory mode: padded to the longest item rounded up to 8), max input "
        f"{cfg.max_input_len:,}; admission latch high/low water {cfg.high_water}/{cfg.low_water} active sequences.  ",
        "Engine: `SimEngine` with default SimParams (prefill 2 us per uncached token, decode step 6 ms + 20 us "
        "per sequence, graph build 50 ms per (padded length, shape, epoch), prefix cache of 1 shape). "
        "**Throughput figures are in SIMULATED GPU seconds** (the fleet's makespan: the latest simulated "
        "time at which a worker finished its last sequence), not wall time; wall time is listed separately."
        + (" Trickle: items arrive at their simulated times and, until the last has arrived, the simulated "
           "clock is paced to the wall clock (never ahead of it), so the conductor's wall-clock timers "
           "(quiet_ms, lane_quiet_ms) line up with arrivals; the offline oracle ignores arrival; throughput "
           "is bounded by the arrival rate."
           if spec.arrival == "trickle" else ""),
        "",
        table(header, rows),
        "",
        "Definitions: batch fill = max(padded tokens / token budget, items / items asked for) (the worker "
        "asks for min(max batch size, free slots under the latch)); padding waste from "
        "the engines' counters; prefix-cache hit = prefix tokens served from the sim's cache / all prefix "
        "tokens; batches per shape = batches that carried items of a shape (median over shapes); claim round "
        "trip = Conductor.claim (with decoding) for the conductor, LPOP + Job.fetch_many for RQ, XREADGROUP "
        "for the stream; Redis memory per queued item = used_memory after submitting the backlog, minus "
        "before, per item; Redis CPU = the server's used_cpu_user+sys over submit and run, per item (the "
        "peers write no results back and keep no lanes; the conductor's figure includes submit.lua, claim.lua "
        "and complete.lua writing every result to the job's results stream). "
        "The oracle's prefix-cache hit is the ceiling on this workload: the sim caches one shape, so every "
        "worker misses once per shape it serves. The sim charges a graph build per (padded length, shape, "
        "epoch): the oracle cuts every batch at a new length, but prewarms its next batch's graph (a prewarm is "
        "free in the sim), so it pays only for its first batch; lanes reuse their length and the conductor "
        "prewarms the next shape's lanes.",
        "",
        "Conductor results: " + "; ".join(f"{c}: {recs[c].complete}" for c in cond) + ".",
        f"conductor-tuned sets {', '.join(f'{k}={v}' for k, v in TUNED_CFG.items())} (defaults: lane_floor 0, "
        "lane_thr_min 0.003).",
        "",
        "Goals (issue 6, on this workload):",
        *goals,
    ]
    if plots:
        here = Path(__file__).resolve().parents[1]
        lines += ["", "Plots: " + ", ".join(f"[{Path(p).name}]({Path(p).relative_to(here)})" for p in plots)]
    return "\n".join(lines)


def make_plots(recs: dict[str, Record], figs: dict[str, dict[str, float]], cfg: SuiteConfig,
               out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    systems = [s for s in SYSTEMS if s in recs]

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in systems:
        fills = batch_fills(recs[s], cfg)
        ax.hist(fills, bins=40, range=(0, 1), histtype="step", label=s, linewidth=1.5)
    ax.set_yscale("log")
    ax.set_xlabel("batch fill (against what the worker asked for)")
    ax.set_ylabel("batches (log scale)")
    ax.set_title("Batch fill")
    ax.legend()
    paths.append(_save(fig, out / "batch_fill.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(systems, [100 * figs[s]["padding_waste"] for s in systems])
    ax.set_ylabel("padding waste, %")
    ax.set_title("Padding waste per system")
    paths.append(_save(fig, out / "padding_waste.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    counts = {s: list(Counter(sig for *_x, sigs in recs[s].batches for sig in sigs).values()) for s in systems}
    top = max((max(v) for v in counts.values() if v), default=1)
    bins = [10 ** (i / 10) for i in range(0, int(10 * math.log10(max(top, 1))) + 2)]
    for s in systems:
        ax.hist(counts[s], bins=bins, histtype="step", label=s, linewidth=1.5)
    ax.set_xscale("log")
    ax.set_xlabel("batches carrying a shape (log scale)")
    ax.set_ylabel("shapes")
    ax.set_title("Batches per shape")
    ax.legend()
    paths.append(_save(fig, out / "batches_per_shape.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in systems:
        trace = sorted(p for e in recs[s].engines for p in e.trace)
        xs, ys, total = [], [], 0
        for t, k in trace:
            total += k
            xs.append(t)
            ys.append(total)
        ax.plot(xs, ys, label=s)
    ax.set_xlabel("simulated seconds (per worker clock)")
    ax.set_ylabel("finished sequences")
    ax.set_title("Finished sequences over simulated time")
    ax.legend()
    paths.append(_save(fig, out / "finished_over_time.png"))
    return paths


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return str(path)


def run_suite(spec: WorkloadSpec, cfg: SuiteConfig, systems: tuple[str, ...] = SYSTEMS,
              log: Callable[[str], None] = print) -> tuple[dict[str, Record], dict[str, dict[str, float]], str]:
    wl = generate(spec)
    recs: dict[str, Record] = {}
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        mach = machine(r)
        log(f"redis-server on port {srv.port}; {mach}")
        for s in systems:
            gc.collect()
            if s == "conductor":
                rec = run_conductor(r, srv.url, wl, cfg)
            elif s == "conductor-tuned":
                rec = run_conductor(r, srv.url, wl, cfg, name=s, model_cfg={**TUNED_CFG, **cfg.conductor_cfg})
            else:
                rec = run_peer(s, r, wl, cfg)
            recs[s] = rec
            fig = figures(rec, cfg)
            log(f"  {s:10s} seq/s(sim) {fig['seq_s']:9.1f}  waste {fig['padding_waste']:.3%}  fill p50 "
                f"{fig['fill_p50']:.1%}  hit {fig['prefix_hit']:.2%}  wall {rec.wall_s:.1f}s  {rec.complete}")
    return recs, {s: figures(r_, cfg) for s, r_ in recs.items()}, mach


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small workload, under 2 minutes")
    p.add_argument("--items", type=int)
    p.add_argument("--shapes", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--arrival", choices=("backlog", "trickle"), default="backlog")
    p.add_argument("--rate", type=float, default=2000.0, help="trickle: items per simulated second")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--no-write", action="store_true", help="print only; RESULTS.md and plots untouched")
    p.add_argument("--json", help="also write the figures as JSON to this file")
    p.add_argument("--conductor-cfg", default="", metavar="K=V,...",
                   help="model config fields for the conductor (conductor/redis_contract/config.py), e.g. lane_floor=8")
    args = p.parse_args(argv)
    spec = WorkloadSpec(items=5_000 if args.quick else 200_000, shapes=20 if args.quick else 50,
                        arrival=args.arrival, rate=args.rate, seed=args.seed)
    cfg = SuiteConfig(workers=2 if args.quick else 4)
    if args.items:
        spec.items = args.items
    if args.shapes:
        spec.shapes = args.shapes
    if args.workers:
        cfg.workers = args.workers
    for kv in filter(None, args.conductor_cfg.split(",")):
        k, _, v = kv.partition("=")
        try:
            cfg.conductor_cfg[k] = parse_value(k, v)
        except ValueError as e:
            p.error(f"--conductor-cfg: {e}")
    systems = tuple(s for s in args.systems.split(",") if s)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)} (known: {', '.join(SYSTEMS)})")
    recs, figs, mach = run_suite(spec, cfg, systems)
    name = ("suite_quick" if args.quick else "suite") + ("" if spec.arrival == "backlog" else "_trickle")
    plot_dir = Path(__file__).resolve().parents[1] / ("plots" if name == "suite" else f"plots/{name}")
    plots = [] if args.no_write else make_plots(recs, figs, cfg, plot_dir)
    text = report(args, mach, spec, cfg, recs, figs, plots)
    publish(text, name, write=not args.no_write, json_path=args.json, data=figs)
    return 0 if all(recs[c].complete.startswith("ok") for c in CONDUCTORS if c in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
