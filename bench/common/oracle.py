"""The offline oracle (issues 6 and 12): the batches a broker that knew every item in advance
would hand out, and the order each worker would run them in.

The rule, in order:

1. **Cut.** Each shape's items, sorted by input length (then id), are cut greedily into batches
   under the contract: the next item joins the open batch while the batch then holds at most
   ``max_batch_size`` items and (memory mode) ``items x pad8(longest input)`` stays within
   ``max_batch_tokens``; otherwise it opens the next batch. Every batch is pure (one shape) and
   full but for the last of each shape, with the least padding a length-sorted cut allows.
2. **Estimate.** Each batch's work is estimated with the cost model the plan is made for (the
   oracle knows every output length, ``conductor.workers.engines.sim.output_len``): ``sim_work`` for the
   sim, ``bench.common.static_cost.estimate`` plus one graph build (every batch has a padded length of
   its own) for the static model; the prefix is taken as cached. (bench/packing/sweep.py makes one plan
   per model and, under the static model, keeps the better of the two plans' runs.)
3. **Balance.** With total work T over N workers, a deep shape (work > T/N) is split into
   p = ceil(work / (T/N)) contiguous length ranges of about equal work; every other shape is one
   piece. Pieces go longest-processing-time first: the largest piece to the least-loaded worker
   (ties: the lower index). Pieces of one shape that land on one worker are merged.
4. **Run.** Each worker runs its own list: its shapes one after another, in the order they were
   assigned (largest first), each shape's batches in length order; so a worker pays one shape
   switch per shape it owns.

Arrival (trickle): a batch is ready when its last item has arrived, and a worker waits for the
batch at the head of its list. ``plan(..., windows=W)`` cuts the items, in arrival order, into W
equal windows and plans each window by the rule above (loads carried over from window to
window), the worker lists being the windows' lists one after another; the caller tries several
W and keeps the best per cost model (W = 1 is the pure rule; more windows trade padding and
switches for earlier ready times). With a backlog only W = 1 is used.

Under the sim (``OracleSource``, one per worker, pulled by ``bench.packing.suite.PeerWorker``): the
admission latch may ask for fewer items than the head batch holds; the source then hands out
that many of its longest items (the batch's padded length) and keeps the rest at the head, as
its next batch. Since the sim charges nothing for a prewarm and the oracle knows its next batch,
the source prewarms the next batch's graph (padded length, shape) as it hands out the current
one: a worker pays a graph build for its first batch only.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conductor.redis_contract.packing import fits, pad8
from conductor.workers.engines.sim import SimParams, output_len


@dataclass(slots=True)
class Item:
    id: str
    sig: str
    tok: int
    mt: int


@dataclass
class OBatch:
    """One planned batch: pure, its items in length order."""

    sig: str
    items: list[Item]
    prefix: int  # the shape's prefix tokens
    out: int  # the longest output in the batch
    outputs: int  # all output tokens of the batch
    ready: float = 0.0  # the latest arrival of its items (simulated seconds)

    @property
    def plen(self) -> int:
        return pad8(max(it.tok for it in self.items))


Work = Callable[[OBatch], float]


def sim_work(p: SimParams | None = None, high_water: int = 1024) -> Work:
    """Work of a batch under the sim: prefill of its padded tokens beyond the (cached) prefix, and
    its output tokens, each costing a sequence's share of a decode step when about ``high_water``
    sequences decode together (decode_per_seq + decode_base / high_water)."""
    p = p or SimParams()
    per_out = p.decode_per_seq + p.decode_base / high_water

    def work(b: OBatch) -> float:
        n = len(b.items)
        return p.prefill_per_token * n * max(0, b.plen - b.prefix) + per_out * b.outputs
    return work


def cut_shape(items: list[Item], prefix: int, size: int, budget: int) -> list[OBatch]:
    """Rule 1 for one shape's items (any order in, sorted here)."""
    out: list[OBatch] = []
    cur: list[Item] = []
    maxlen = 0
    for it in sorted(items, key=lambda i: (i.tok, i.id)):
        if cur and not fits(len(cur), maxlen, it.tok, size, budget):
            out.append(_batch(cur, prefix))
            cur, maxlen = [], 0
        cur.append(it)
        maxlen = max(maxlen, it.tok)
    if cur:
        out.append(_batch(cur, prefix))
    return out


def _batch(items: list[Item], prefix: int) -> OBatch:
    outs = [output_len(it.id, it.mt) for it in items]
    return OBatch(items[0].sig, items, prefix, max(outs), sum(outs))


def _split(batches: list[OBatch], parts: int, work: Work) -> list[list[OBatch]]:
    """Contiguous runs of about equal work (batches stay in length order)."""
    total = sum(work(b) for b in batches)
    out: list[list[OBatch]] = [[]]
    acc = 0.0
    for b in batches:
        w = work(b)
        if out[-1] and len(out) < parts and acc + w / 2 > total * len(out) / parts:
            out.append([])
        out[-1].append(b)
        acc += w
    return out


@dataclass
class Plan:
    """Each worker's batches in the order it runs them."""

    workers: list[list[OBatch]]
    windows: int = 1
    loads: list[float] = field(default_factory=list)  # estimated work per worker

    def batches(self) -> int:
        return sum(len(w) for w in self.workers)


def plan(items: Sequence[Any], prefixes: dict[str, int], n_workers: int, size: int, budget: int,
         work: Work, arrival: Sequence[float] | None = None, windows: int = 1) -> Plan:
    """The oracle's plan (rules 1-4). ``items``: objects with id, sig, input_tokens, max_tokens
    (``conductor.formats.lines.PreparedItem``), in arrival order; ``arrival``: each item's arrival time
    (None: all at 0)."""
    n = len(items)
    windows = max(1, min(windows, n))
    ready_of = {} if arrival is None else {it.id: t for it, t in zip(items, arrival, strict=True)}
    lists: list[list[OBatch]] = [[] for _ in range(n_workers)]
    loads = [0.0] * n_workers
    for w in range(windows):
        chunk = items[w * n // windows:(w + 1) * n // windows]
        by_shape: dict[str, list[Item]] = {}
        for p in chunk:
            by_shape.setdefault(p.sig, []).append(Item(p.id, p.sig, p.input_tokens, p.max_tokens))
        shapes = [(sig, cut_shape(its, prefixes[sig], size, budget)) for sig, its in by_shape.items()]
        for _sig, bs in shapes:
            for b in bs:
                b.ready = max((ready_of.get(it.id, 0.0) for it in b.items), default=0.0)
        total = sum(work(b) for _s, bs in shapes for b in bs)
        share = total / n_workers if total > 0 else math.inf
        pieces: list[tuple[float, int, list[OBatch]]] = []
        for order, (_sig, bs) in enumerate(shapes):
            wsum = sum(work(b) for b in bs)
            parts = min(n_workers, len(bs), max(1, math.ceil(wsum / share - 1e-9))) if share < math.inf else 1
            for piece in (_split(bs, parts, work) if parts > 1 else [bs]):
                pieces.append((sum(work(b) for b in piece), order, piece))
        pieces.sort(key=lambda x: (-x[0], x[1]))
        heap = [(loads[i], i) for i in range(n_workers)]
        heapq.heapify(heap)
        own: list[dict[str, list[OBatch]]] = [{} for _ in range(n_workers)]
        for wsum, _order, piece in pieces:
            load, i = heapq.heappop(heap)
            own[i].setdefault(piece[0].sig, []).extend(piece)
            loads[i] = load + wsum
            heapq.heappush(heap, (loads[i], i))
        for i in range(n_workers):
            for bs in own[i].values():
                lists[i].extend(sorted(bs, key=lambda b: (b.plen, b.items[0].tok, b.items[0].id)))
    return Plan(lists, windows, loads)


class OracleClock:
    """Lets oracle sources see the simulated time of the worker about to take its turn.

    Passed to ``bench.packing.suite.drive`` as its ``release``: called with that worker's clock before
    each turn; ``pending`` is False, so the drive never paces the oracle to the wall clock."""

    pending = False

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self, now: float) -> None:
        self.now = now


class OracleSource:
    """One worker's planned batches, handed out in order (see the module docstring)."""

    def __init__(self, batches: list[OBatch], engine: Any = None, clock: OracleClock | None = None) -> None:
        self.batches = [(b.sig, b.items, b.ready) for b in batches]
        self.head = 0
        self.engine = engine
        self.clock = clock

    def _prewarm(self, i: int) -> None:
        if i < len(self.batches):
            sig, items, _ready = self.batches[i]
            self.engine.prewarm(sig, [pad8(max(it.tok for it in items))], 0)

    def next_batch(self, size: int) -> list[Item]:
        if self.head >= len(self.batches):
            return []
        sig, items, ready = self.batches[self.head]
        if self.clock is not None and ready > self.clock.now:
            return []
        if len(items) > size:
            self.batches[self.head] = (sig, items[:-size], ready)
            if self.engine is not None:
                self._prewarm(self.head)
            return items[-size:]
        self.head += 1
        if self.engine is not None:
            self._prewarm(self.head)
        return items
