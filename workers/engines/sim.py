"""``sim``: a GPU cost model. It is a SIMULATION: no model runs, outputs are placeholders.

It exists for demos, tests and benchmarks, so that batching quality (padding, shape
switches, prefix-cache reuse, graph reuse, admission policy) turns into time the way it
would on a GPU. Parameters (``SimParams``), all in simulated seconds:

* ``prefill_per_token``: prefill cost of each uncached token; padding tokens cost like real
  ones (a batch prefills ``padded_len`` tokens per item).
* ``decode_base`` + ``decode_per_seq`` x active sequences: one decode step; every active
  sequence advances one token per step.
* prefix cache: holds the prefix of ``cache_shapes`` shape signatures (LRU). A hit skips the
  prefix tokens of every item; a switch to a shape not held loses the oldest.
* graph cache: keyed by (lane padded length, shape, epoch); a miss costs ``graph_build``.
  ``prewarm`` builds graphs ahead, off the critical path.
* output length: drawn deterministically from the item id (and its request's ``seed``, when it has
  one: the same seed gives the same output, another seed another length), between 1/4 and all of
  max_tokens. A request's ``stop`` strings cut the placeholder text before the first one found, and
  its output tokens in proportion. ``temperature`` and ``top_p`` change nothing: nothing is sampled.
* ``kv_capacity_tokens`` (0: unlimited): the KV memory, in tokens. A sequence holds its
  padded prompt plus what it generated so far. When a decode step would need more, sequences
  are preempted: their KV is dropped, so are the tokens they generated, and each comes back,
  oldest first, when room returns, paying its prefill again. ``preempt`` picks the victim:
  ``largest`` (the sequence holding the most KV, which frees the most memory per eviction:
  what a runtime without admission control does, and how seed 000's engine ended up
  advancing thousands of sequences that never finished) or ``newest`` (the last admitted,
  vLLM's recompute policy, which protects old sequences and so wastes less). Either way an
  engine admitted into without limit keeps prefilling and decoding, so tokens/s stays high,
  for sequences that lose their work.

* ``max_num_seqs`` (default: the batch size, as vLLM's batch is its ``max_num_seqs``; 0: no limit):
  sequences it runs at once. What it is given beyond them waits in the engine, first in first out,
  and starts (paying its prefill then) as running ones finish. ``room`` is a real engine's: a batch's
  worth once what has not started is under half the last batch it got, else none, so the worker
  holds about one batch beyond what runs and the backlog stays in Redis, where cancels, priorities
  and fair share still act on it. With 0 it runs whatever it is given at once and asks for no room
  of its own (seed 000's engine admitted into without limit: bench/engines/latch_bench.py).

``time_scale`` multiplies the sleeps (0: never sleep, only count). Counters: simulated time,
prefix hit and miss tokens, padding tokens, graph rebuilds, shape switches, steps.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

import xxhash

from conductor.formats.items import estimate_tokens
from conductor.formats.openai_options import request_options
from conductor.redis_contract.records import Batch, BatchItem, Contract

from .base import ContractHolder, Finished, too_long
from .waiting import HoldsWaiting, Waiting


@dataclass
class SimParams:
    prefill_per_token: float = 2e-6
    decode_base: float = 0.006
    decode_per_seq: float = 2e-5
    graph_build: float = 0.05
    cache_shapes: int = 1
    kv_capacity_tokens: int = 0
    preempt: str = "largest"


@dataclass
class SimCounters:
    sim_seconds: float = 0.0
    prefix_hit_tokens: int = 0
    prefix_miss_tokens: int = 0
    prefill_tokens: int = 0
    padding_tokens: int = 0
    actual_tokens: int = 0
    graph_rebuilds: int = 0
    graphs_prewarmed: int = 0
    shape_switches: int = 0
    steps: int = 0
    finished: int = 0
    output_tokens: int = 0
    useful_output_tokens: int = 0
    preemptions: int = 0
    lost_tokens: int = 0
    recompute_tokens: int = 0
    shapes_seen: list[str] = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        total = self.prefix_hit_tokens + self.prefix_miss_tokens
        return self.prefix_hit_tokens / total if total else 1.0


class _Seq:
    __slots__ = ("order", "fin", "prompt", "target", "done")

    def __init__(self, order: int, fin: Finished, prompt: int, target: int) -> None:
        self.order, self.fin, self.prompt, self.target, self.done = order, fin, prompt, target, 0


def output_len(item_id: str, max_tokens: int, seed: int | None = None) -> int:
    key = item_id if seed is None else f"{item_id}\0{seed}"
    frac = (xxhash.xxh64_intdigest(key.encode("utf-8")) % 10_000) / 10_000
    return max(1, min(max_tokens, round(max_tokens * (0.25 + 0.75 * frac))))


def sim_output(it: BatchItem) -> tuple[str, int]:
    """The placeholder text of ``it`` and its output tokens, under its request options."""
    opts = request_options(it.payload)
    n = output_len(it.id, it.max_tokens, opts.get("seed"))
    text = f"<sim output: {n} tokens>"
    cut = min((i for i in (text.find(s) for s in opts.get("stop", ())) if i >= 0), default=-1)
    if cut >= 0:
        n, text = max(1, n * cut // len(text)), text[:cut]
    return text, n


class SimEngine(HoldsWaiting, ContractHolder):
    kind = "sim"

    def __init__(self, model: str, *, max_batch_size: int = 64, max_batch_tokens: int = 8192,
                 max_input_len: int = 4096, time_scale: float = 0.0, params: SimParams | None = None,
                 max_num_seqs: int | None = None) -> None:
        self._contract = Contract(model=model, max_batch_size=max_batch_size,
                                  max_batch_tokens=max_batch_tokens, max_input_len=max_input_len)
        self.time_scale = time_scale
        self.p = params or SimParams()
        self._waiting = Waiting(max_batch_size if max_num_seqs is None else max_num_seqs, max_batch_size)
        self.counters = SimCounters()
        self._prefix_lru: list[str] = []
        self._graphs: set[tuple[int, str, int]] = set()
        self._heap: list[tuple[int, int, Finished]] = []
        # Only with a KV capacity: sequences holding KV, and preempted ones waiting for room.
        self._resident: list[_Seq] = []
        self._evicted: deque[_Seq] = deque()
        self._seq = 0
        self._step_no = 0

    def _spend(self, seconds: float) -> None:
        self.counters.sim_seconds += seconds
        if self.time_scale > 0:
            time.sleep(seconds * self.time_scale)

    def _prefix_hit(self, shape: str) -> bool:
        if shape in self._prefix_lru:
            self._prefix_lru.remove(shape)
            self._prefix_lru.append(shape)
            return True
        if self.counters.shapes_seen and self.counters.shapes_seen[-1] != shape:
            self.counters.shape_switches += 1
        self.counters.shapes_seen.append(shape)
        self._prefix_lru.append(shape)
        del self._prefix_lru[:-self.p.cache_shapes]
        return False

    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        refused = [too_long(batch, it, self._contract.max_input_len)
                   for it in items if it.input_tokens > self._contract.max_input_len]
        items = [it for it in items if it.input_tokens <= self._contract.max_input_len]
        if not items:
            return refused
        self._waiting.add(batch, items)
        self._start()
        return refused

    def _running(self) -> int:
        return len(self._heap) + len(self._resident) + len(self._evicted)

    def _start(self) -> None:
        for batch, items in self._waiting.startable(self._running):
            self._prefill(batch, items)

    def _prefill(self, batch: Batch, items: list[BatchItem]) -> None:
        """Items of one batch starting together: their prefill (prefix cache, padding, graph) is paid now."""
        c = self.counters
        plen = batch.padded_len
        prefix_tokens = min(estimate_tokens(batch.prefix, "") if batch.prefix else 0,
                            min(it.input_tokens for it in items))
        hit = self._prefix_hit(batch.shape)
        cached = prefix_tokens if hit else 0
        if not hit and prefix_tokens:
            # The first sequence computes the prefix; the rest of the batch shares it.
            cached_after_first = prefix_tokens * (len(items) - 1)
        else:
            cached_after_first = 0
        actual = sum(it.input_tokens for it in items)
        padded = plen * len(items)
        hit_tokens = cached * len(items) + cached_after_first
        compute = max(0, padded - hit_tokens)
        c.prefix_hit_tokens += hit_tokens
        c.prefix_miss_tokens += prefix_tokens * len(items) - hit_tokens
        c.prefill_tokens += compute
        c.padding_tokens += padded - actual
        c.actual_tokens += actual
        cost = compute * self.p.prefill_per_token
        gkey = (plen, batch.shape, batch.epoch)
        if gkey not in self._graphs:
            c.graph_rebuilds += 1
            self._graphs.add(gkey)
            cost += self.p.graph_build
        self._spend(cost)
        for it in items:
            text, n = sim_output(it)
            self._seq += 1
            fin = Finished(batch, it, text, n)
            if self.p.kv_capacity_tokens:
                self._resident.append(_Seq(self._seq, fin, plen, n))
            else:
                heapq.heappush(self._heap, (self._step_no + n, self._seq, fin))

    def _kv(self) -> int:
        return sum(q.prompt + q.done for q in self._resident)

    def _step_capped(self) -> list[Finished]:
        """One decode step under a KV capacity: preempt the newest to fit, readmit the oldest."""
        c, cap = self.counters, self.p.kv_capacity_tokens
        kv = self._kv()
        if kv + len(self._resident) > cap:
            if self.p.preempt == "newest":
                self._resident.sort(key=lambda q: q.order)
            else:
                self._resident.sort(key=lambda q: (q.prompt + q.done, q.order))
            while len(self._resident) > 1 and kv + len(self._resident) > cap:
                q = self._resident.pop()
                kv -= q.prompt + q.done
                c.preemptions += 1
                c.lost_tokens += q.done
                q.done = 0
                self._evicted.append(q)
        recompute = 0
        while self._evicted and (not self._resident
                                 or kv + len(self._resident) + self._evicted[0].prompt + 1 <= cap):
            q = self._evicted.popleft()
            self._resident.append(q)
            kv += q.prompt
            recompute += q.prompt
        if recompute:
            c.recompute_tokens += recompute
            c.prefill_tokens += recompute
            self._spend(recompute * self.p.prefill_per_token)
        self._spend(self.p.decode_base + self.p.decode_per_seq * len(self._resident))
        c.output_tokens += len(self._resident)
        done: list[_Seq] = []
        keep: list[_Seq] = []
        for q in self._resident:
            q.done += 1
            (done if q.done >= q.target else keep).append(q)
        self._resident = keep
        c.finished += len(done)
        c.useful_output_tokens += sum(q.target for q in done)
        return [q.fin for q in done]

    def step(self) -> list[Finished]:
        self._start()
        done = self._decode()
        self._start()  # into the seats the finished ones left, so room() says what waits
        return done

    def _decode(self) -> list[Finished]:
        if self.p.kv_capacity_tokens:
            if not (self._resident or self._evicted):
                return []
            self._step_no += 1
            self.counters.steps += 1
            return self._step_capped()
        if not self._heap:
            return []
        self._step_no += 1
        self.counters.steps += 1
        self._spend(self.p.decode_base + self.p.decode_per_seq * len(self._heap))
        self.counters.output_tokens += len(self._heap)
        done = []
        while self._heap and self._heap[0][0] <= self._step_no:
            done.append(heapq.heappop(self._heap)[2])
        self.counters.finished += len(done)
        self.counters.useful_output_tokens += sum(f.output_tokens for f in done)
        return done

    def active(self) -> int:
        return self._running() + self._waiting.items

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        for plen in lanes:
            if (plen, shape, epoch) not in self._graphs:
                self._graphs.add((plen, shape, epoch))
                self.counters.graphs_prewarmed += 1

    def close(self) -> None:
        self._waiting.clear()
        self._heap.clear()
        self._resident.clear()
        self._evicted.clear()
