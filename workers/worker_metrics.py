"""The worker's Prometheus figures (objects in conductor/observability/metrics.py), bound to one model and worker.

Kept out of the loop's code so the loop reads as the ladder it is: each method is one moment
of a turn (a batch claimed, a step taken, results written, the state at the end of a turn).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from conductor.observability import metrics as M
from conductor.redis_contract.records import Batch, Result


class WorkerMetrics:
    def __init__(self, model: str, worker: str, budget_tokens: int) -> None:
        self.model = model
        self.budget_tokens = budget_tokens
        lw = (model, worker)
        self.active = M.ACTIVE_SEQUENCES.labels(*lw)
        self.gated = M.LATCH_GATED.labels(*lw)
        self.transitions = M.LATCH_TRANSITIONS.labels(*lw)
        self.finished = M.FINISHED.labels(*lw)
        self.output_tokens = M.OUTPUT_TOKENS.labels(*lw)
        self.step_seconds = M.STEP_SECONDS.labels(*lw)
        self.retry_depth = M.RETRY_BUFFER.labels(*lw)
        self.claim_seconds = M.CLAIM_SECONDS.labels(*lw)
        self.shape_switches = M.SHAPE_SWITCHES.labels(*lw)
        self.prefix_hits = M.PREFIX_HIT_TOKENS.labels(*lw)
        self.engine_queries = M.ENGINE_PREFIX_QUERIES.labels(*lw)
        self.engine_hits = M.ENGINE_PREFIX_HITS.labels(*lw)
        self._seen: dict[str, int] = {}
        self.fill = M.BATCH_FILL.labels(*lw)
        self.size = M.BATCH_SIZE.labels(*lw)
        self.padded = M.PADDED_TOKENS.labels(*lw)
        self.actual = M.ACTUAL_TOKENS.labels(*lw)
        self.warm = M.WARM_CLAIMS.labels(*lw)
        self.warm_ratio = M.WARM_CLAIM_RATIO.labels(*lw)
        self.busy = M.BUSY_SECONDS.labels(*lw)
        self.idle_with_work = M.IDLE_WITH_WORK_SECONDS.labels(*lw)
        self._lw = lw
        self._last_shape = ""
        self._transitions_seen = 0
        self._claims = self._warm_claims = 0
        self.busy_s = 0.0  # also published in Redis with each heartbeat (the broker's balance gauge)
        self._since = time.monotonic()
        self._was = ""  # what the time since ``_since`` counts as: busy, waiting or ''

    def forget(self) -> None:
        """Drop this worker's series (a worker renamed at start leaves none under its old name)."""
        for fam in (M.ACTIVE_SEQUENCES, M.LATCH_GATED, M.LATCH_TRANSITIONS, M.FINISHED, M.OUTPUT_TOKENS,
                    M.STEP_SECONDS, M.RETRY_BUFFER, M.CLAIM_SECONDS, M.SHAPE_SWITCHES, M.PREFIX_HIT_TOKENS,
                    M.ENGINE_PREFIX_QUERIES, M.ENGINE_PREFIX_HITS,
                    M.BATCH_FILL, M.BATCH_SIZE, M.PADDED_TOKENS, M.ACTUAL_TOKENS, M.WARM_CLAIMS,
                    M.WARM_CLAIM_RATIO, M.BUSY_SECONDS, M.IDLE_WITH_WORK_SECONDS):
            try:
                fam.remove(*self._lw)
            except KeyError:
                pass

    def clock(self, busy: bool, work_waits: bool) -> None:
        """At the end of a turn: the time since the last call counts as what the worker was then
        (its state holds until the next turn: an idle worker blocks on the doorbell in between)."""
        now = time.monotonic()
        dt, self._since = now - self._since, now
        if self._was == "busy":
            self.busy_s += dt
            self.busy.inc(dt)
        elif self._was == "waiting":
            self.idle_with_work.inc(dt)
        self._was = "busy" if busy else "waiting" if work_waits else ""

    def claimed(self, batch: Batch) -> None:
        self.size.observe(len(batch.items))
        self.fill.observe(batch.padded_tokens / self.budget_tokens if self.budget_tokens else 0.0)
        self.padded.inc(batch.padded_tokens)
        self.actual.inc(batch.actual_tokens)
        if self._last_shape and batch.shape != self._last_shape:
            self.shape_switches.inc()
        elif self._last_shape:
            self._warm_claims += 1
            self.warm.inc()
        self._claims += 1
        self.warm_ratio.set(self._warm_claims / self._claims)
        self._last_shape = batch.shape

    def claim_took(self, seconds: float) -> None:
        self.claim_seconds.observe(seconds)

    def stepped(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def written(self, results: Sequence[Result]) -> None:
        """Counted when the write lands: a finished sequence whose result is lost is worth nothing."""
        self.finished.inc(len(results))
        self.output_tokens.inc(sum(r.output_tokens for r in results))

    def state(self, active: int, gated: bool, transitions: int, retry_depth: int) -> None:
        self.active.set(active)
        self.gated.set(1 if gated else 0)
        if transitions > self._transitions_seen:
            self.transitions.inc(transitions - self._transitions_seen)
            self._transitions_seen = transitions
        self.retry_depth.set(retry_depth)

    def engine_counters(self, counters: object) -> None:
        """The engine's own tallies, where it keeps them: prefix-cache hits in the items' input tokens
        (sim, torch, vllm, openai when the server reports cached tokens), and vLLM's own prefix-cache
        queries and hits in its tokens."""
        for field, counter in (("prefix_hit_tokens", self.prefix_hits), ("prefix_queries", self.engine_queries),
                               ("prefix_hits", self.engine_hits)):
            now = getattr(counters, field, None)
            seen = self._seen.get(field, 0)
            if isinstance(now, int) and now > seen:
                counter.inc(now - seen)
                self._seen[field] = now
