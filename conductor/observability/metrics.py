"""The worker's Prometheus series (updated in the worker loop, served on --metrics-port).

Every series carries ``model`` and ``worker``, so a fleet's dashboards can sum or split by
either, and gauge names end in their unit. Batch fill, padded against actual tokens (padding
waste = 1 - actual/padded), finished sequences and output tokens (rates in PromQL), active
sequences, latch state, engine step and claim time, retry buffer, prefix-cache hits, shape
switches, warm claims (the previous batch's shape again), busy time (its max/mean over the fleet
is the broker's balance gauge) and idle time while work waits; the maintenance lease holder adds
batches per shape, thrashing shapes, counter drift and the disk tier's feed stalls.
The broker's own figures (queues, lanes, jobs) are read from Redis at scrape time by
``conductor.observability.broker_metrics.ModelStateCollector``, which ``conductor exporter`` serves.
"""

from __future__ import annotations

import contextvars
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

LW = ["model", "worker"]

BATCH_FILL = Histogram("conductor_batch_fill_ratio", "Padded tokens of a batch over the contract's token budget",
                       LW, buckets=(0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0))
BATCH_SIZE = Histogram("conductor_batch_items", "Items per claimed batch", LW,
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
PADDED_TOKENS = Counter("conductor_padded_tokens", "Input tokens dispatched, counted padded", LW)
ACTUAL_TOKENS = Counter("conductor_actual_tokens", "Input tokens dispatched, counted actual", LW)
FINISHED = Counter("conductor_finished_sequences", "Sequences finished and written back", LW)
OUTPUT_TOKENS = Counter("conductor_output_tokens", "Output tokens generated", LW)
ACTIVE_SEQUENCES = Gauge("conductor_worker_active_sequences", "Sequences alive in the engine", LW)
LATCH_GATED = Gauge("conductor_worker_latch_gated", "1 while the admission latch holds new prefills", LW)
LATCH_TRANSITIONS = Counter("conductor_worker_latch_transitions", "Admission latch flips", LW)
STEP_SECONDS = Histogram("conductor_engine_step_seconds", "Engine decode step time", LW)
CLAIM_SECONDS = Histogram("conductor_claim_seconds", "Claim round trip (claim.lua and the read of its items)", LW,
                          buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
RETRY_BUFFER = Gauge("conductor_worker_retry_buffer_batches", "Batches whose result writes wait for Redis", LW)
PREFIX_HIT_TOKENS = Counter("conductor_prefix_hit_tokens", "Input tokens the engine's prefix cache served "
                            "(not computed)", LW)
ENGINE_PREFIX_QUERIES = Counter("conductor_engine_prefix_cache_queries", "Prompt tokens the engine looked up in its "
                                "prefix cache, in the engine's own tokens (engines that count them: vllm)", LW)
ENGINE_PREFIX_HITS = Counter("conductor_engine_prefix_cache_hits", "Prompt tokens the engine's prefix cache held, in "
                             "the engine's own tokens (engines that count them: vllm)", LW)
SHAPE_SWITCHES = Counter("conductor_worker_shape_switches", "Batches whose shape differs from the previous one", LW)
WARM_CLAIMS = Counter("conductor_worker_warm_claims", "Batches of the shape the worker's previous batch had (a warm "
                      "prefix)", LW)
WARM_CLAIM_RATIO = Gauge("conductor_worker_warm_claim_ratio", "Warm claims over all claims since the worker started",
                         LW)
BUSY_SECONDS = Counter("conductor_worker_busy_seconds", "Time with sequences in the engine", LW)
IDLE_WITH_WORK_SECONDS = Counter("conductor_worker_idle_with_work_seconds", "Time with no sequence in the engine while "
                                 "work waited: the last claim answered 'wait' or 'gate' (held back), not 'idle'", LW)
BATCHES_PER_SHAPE = Histogram("conductor_batches_per_shape", "Batches a shape instance ran before it finished", LW,
                              buckets=(1, 10, 50, 100, 500, 1000, 5000, 10000))
THRASHING_SHAPES = Counter("conductor_thrashing_shapes", "Shapes that ran in more than twice the batches their "
                           "items could fill, under 100 batches", LW)
# The disk tier's feed refused over maxmemory (workers/feed_stall.py): a stall is a state with an
# age (deploy/prometheus/alerts.yml ConductorFeedStalled), not a line per refused feed.
FEED_STALLED = Gauge("conductor_feed_stalled", "1 while the lease holder's feed of store segments is refused "
                     "(Redis over maxmemory)", LW)
FEED_STALL_AGE = Gauge("conductor_feed_stall_age_seconds", "How long the current feed stall has lasted (0: none)", LW)
FEED_FAILURES = Counter("conductor_feed_failures", "Feeds of store segments refused (Redis over maxmemory, a store "
                        "that does not answer)", LW)

# The worker this thread works for: code that knows only the model (conductor/verify/'s drift
# check, run by the maintenance lease holder) still labels its series with the worker's name.
WORKER: contextvars.ContextVar[str] = contextvars.ContextVar("conductor_worker", default="")


class _WorkerBound:
    """A metric whose callers give every label but ``worker``, which comes from WORKER."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric

    def labels(self, *values: str) -> Any:
        return self.metric.labels(*values, WORKER.get())


DRIFT = _WorkerBound(Gauge("conductor_counter_drift", "Sum of |counter - the truth it counts| over the counters "
                           "of one kind (conductor/verify/; 0 = exact), set by the maintenance lease holder",
                           ["model", "counter", "worker"]))
