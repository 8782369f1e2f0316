"""A second cost model (issue 12): static batches, independent of ``conductor.workers.engines.sim``.

It replays, per worker, the batches that worker received, in the order received, and prices
them as a static-batch engine would: a batch runs to completion before the next one starts (no
continuous batching, no admission latch, no prewarm). One batch of n items padded to ``plen``:

* prefill: ``prefill_per_token`` x padded uncached tokens = n x plen minus the shape's prefix
  tokens of every item when this worker's previous batch had the same shape (the prefix is in
  its cache), else of every item but the first (the first computes it, the rest share it);
* decode: the longest output in the batch (``conductor.workers.engines.sim.output_len``, the output
  every system's engine produces for the item) decode steps, each ``decode_base`` +
  ``decode_per_seq`` x n;
* ``graph_build`` when (plen, shape) is new to this worker.

A batch that mixes shapes (the FIFO peers' batches) is priced as one batch: each shape's group
pays its prefill as above (the cache holds the group before it), one decode for the whole
batch, a graph per (plen, shape) of each group.

Arrival: a batch is ready at the latest arrival time of its items; a worker's clock is
max(clock, ready) + cost. Finished sequences/s = items / the latest worker clock.

Parameters (``StaticParams``) are deliberately unlike the sim's (2 us per prefill token, decode
step 6 ms + 20 us per sequence, graph 50 ms, continuous batching): 1 us per prefill token, decode
step 10 ms + 50 us per sequence, graph build 0.2 s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from conductor.workers.engines.sim import output_len


@dataclass(frozen=True)
class StaticParams:
    prefill_per_token: float = 1e-6
    decode_base: float = 0.010
    decode_per_seq: float = 5e-5
    graph_build: float = 0.2

    def describe(self) -> str:
        return (f"prefill {self.prefill_per_token * 1e6:g} us per padded uncached token, decode step "
                f"{self.decode_base * 1e3:g} ms + {self.decode_per_seq * 1e6:g} us per sequence, graph build "
                f"{self.graph_build:g} s per (padded length, shape) new to a worker, batches one after another")


@dataclass
class SBatch:
    """One batch as a worker received it: its padded length and its (shape, item ids) groups."""

    plen: int
    groups: list[tuple[str, list[str]]]


@dataclass
class StaticResult:
    items: int = 0
    makespan: float = 0.0
    clocks: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    graph_s: float = 0.0
    wait_s: float = 0.0  # time workers waited for a batch's items to arrive
    graphs: int = 0
    batches: int = 0

    @property
    def seq_s(self) -> float:
        return self.items / self.makespan if self.makespan > 0 else float("nan")

    def as_dict(self) -> dict[str, float]:
        return {"seq_s": self.seq_s, "makespan": self.makespan, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "graph_s": self.graph_s, "wait_s": self.wait_s,
                "graphs": self.graphs, "batches": self.batches}


class Items:
    """What the model needs of every item: input tokens, output length, arrival time."""

    def __init__(self, items: Sequence[object], arrival: Sequence[float], prefixes: dict[str, int]) -> None:
        self.info: dict[str, tuple[int, int, float]] = {
            it.id: (it.input_tokens, output_len(it.id, it.max_tokens), t)  # type: ignore[attr-defined]
            for it, t in zip(items, arrival, strict=True)}
        self.prefixes = prefixes


def batches_from_log(log: Iterable[tuple[str, str, int, list[str]]]) -> list[SBatch]:
    """A worker's engine admissions (batch id, shape, padded length, item ids), consecutive
    admissions of one batch id merged into one batch."""
    out: list[SBatch] = []
    last = None
    for bid, shape, plen, ids in log:
        if not ids:
            continue
        if bid == last:
            out[-1].groups.append((shape, list(ids)))
        else:
            out.append(SBatch(plen, [(shape, list(ids))]))
            last = bid
    return out


def estimate(p: StaticParams, n: int, plen: int, prefix: int, longest_out: int) -> float:
    """Stateless work of a pure batch (prefix cached, graph built): the oracle's planning yardstick."""
    return p.prefill_per_token * n * max(0, plen - prefix) + longest_out * (p.decode_base + p.decode_per_seq * n)


def replay(workers: Sequence[Sequence[SBatch]], items: Items, p: StaticParams | None = None) -> StaticResult:
    p = p or StaticParams()
    res = StaticResult()
    info = items.info
    for batches in workers:
        clock = 0.0
        prev: str | None = None
        graphs: set[tuple[int, str]] = set()
        for b in batches:
            n = 0
            uncached = 0
            longest = 0
            ready = 0.0
            gcost = 0.0
            for shape, ids in b.groups:
                k = len(ids)
                toks = [info[i][0] for i in ids]
                pre = min(items.prefixes.get(shape, 0), min(toks))
                uncached += k * b.plen - (k * pre if prev == shape else (k - 1) * pre)
                prev = shape
                for i in ids:
                    _tok, out, t = info[i]
                    longest = max(longest, out)
                    ready = max(ready, t)
                if (b.plen, shape) not in graphs:
                    graphs.add((b.plen, shape))
                    gcost += p.graph_build
                    res.graphs += 1
                n += k
            prefill = p.prefill_per_token * uncached
            decode = longest * (p.decode_base + p.decode_per_seq * n)
            if ready > clock:
                res.wait_s += ready - clock
                clock = ready
            clock += prefill + decode + gcost
            res.prefill_s += prefill
            res.decode_s += decode
            res.graph_s += gcost
            res.items += n
            res.batches += 1
        res.clocks.append(clock)
    res.makespan = max(res.clocks, default=0.0)
    return res
