"""Prometheus metrics for what the seeds measure.

Worker-side (updated in the worker loop): batch fill, padding tokens against actual tokens
(padding waste = 1 - actual/padded), finished sequences and output tokens (rates in PromQL),
active slots, latch state, engine step time, retry-buffer depth.
Broker-side (read from Redis at scrape time by ``ModelStateCollector``): waiting tokens and
items, shape switches (activations), cleanup entries/time/batches/items, lane pressure,
starving lanes, reclaimed and dead-lettered items.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

BATCH_FILL = Histogram("conductor_batch_fill_ratio", "Padded tokens of a batch over the contract's token budget",
                       ["model"], buckets=(0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0))
BATCH_SIZE = Histogram("conductor_batch_items", "Items per claimed batch", ["model"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
PADDED_TOKENS = Counter("conductor_padded_tokens", "Input tokens dispatched, counted padded", ["model"])
ACTUAL_TOKENS = Counter("conductor_actual_tokens", "Input tokens dispatched, counted actual", ["model"])
FINISHED = Counter("conductor_finished_sequences", "Sequences finished and written back", ["model", "worker"])
OUTPUT_TOKENS = Counter("conductor_output_tokens", "Output tokens generated", ["model", "worker"])
ACTIVE_SLOTS = Gauge("conductor_worker_active_slots", "Sequences alive in the engine", ["model", "worker"])
LATCH_GATED = Gauge("conductor_worker_latch_gated", "1 while the admission latch holds new prefills",
                    ["model", "worker"])
LATCH_TRANSITIONS = Counter("conductor_worker_latch_transitions", "Admission latch flips", ["model", "worker"])
STEP_SECONDS = Histogram("conductor_engine_step_seconds", "Engine decode step time", ["model", "worker"])
RETRY_DEPTH = Gauge("conductor_worker_retry_buffer", "Result writes waiting for Redis", ["model", "worker"])
PREFIX_HIT_TOKENS = Counter("conductor_prefix_hit_tokens", "Input tokens the engine's prefix cache served "
                            "(not computed)", ["model", "worker"])
SHAPE_SWITCHES = Counter("conductor_worker_shape_switches", "Batches whose shape differs from the previous one",
                         ["model", "worker"])
BATCHES_PER_SHAPE = Histogram("conductor_batches_per_shape", "Batches a shape instance ran before it finished",
                              ["model"], buckets=(1, 10, 50, 100, 500, 1000, 5000, 10000))
THRASHING_SHAPES = Counter("conductor_thrashing_shapes", "Shapes that finished in under 100 batches", ["model"])
DRIFT = Gauge("conductor_counter_drift", "Sum of |counter - the truth it counts| over the counters of one kind "
              "(conductor/verify.py; 0 = exact), set by the maintenance lease holder", ["model", "counter"])


class ModelStateCollector(Collector):
    """Broker-side figures, read from Redis on every scrape."""

    STATE_GAUGES = {
        "tokens": "conductor_waiting_tokens",
        "items": "conductor_waiting_items",
        "inflight_items": "conductor_inflight_items",
        "reclaimed_items": "conductor_reclaimed_items",
        "cleanup": "conductor_cleanup_active",
        "paused": "conductor_model_paused",
    }
    STATE_COUNTERS = {
        "activations": "conductor_shape_activations",
        "cleanup_entries": "conductor_cleanup_entries",
        "cleanup_batches": "conductor_cleanup_batches",
        "cleanup_items": "conductor_cleanup_items",
        "dead_lettered": "conductor_dead_lettered_items",
        "completed": "conductor_completed_items",
        "failed": "conductor_failed_items",
    }

    def __init__(self, conductor, starving_s: float = 30.0) -> None:  # noqa: ANN001
        self.c = conductor
        self.starving_ms = starving_s * 1000

    def collect(self) -> Iterator:
        from conductor.inspect import model_overview

        gauges = {k: GaugeMetricFamily(n, n.replace("_", " "), labels=["model"]) for k, n in self.STATE_GAUGES.items()}
        counters = {k: CounterMetricFamily(n, n.replace("_", " "), labels=["model"])
                    for k, n in self.STATE_COUNTERS.items()}
        pressure = GaugeMetricFamily("conductor_lane_pressure", "Lanes in use over the lane budget, active shape",
                                     labels=["model"])
        starving = GaugeMetricFamily("conductor_starving_lanes", "Lanes whose head waited over 30 s",
                                     labels=["model"])
        cleanup_s = CounterMetricFamily("conductor_cleanup_seconds", "Time spent in cleanup mode", labels=["model"])
        now = time.time() * 1000
        for model in self.c.models():
            ov = model_overview(self.c, model, lanes=True)
            st = ov["state"]
            for k, fam in gauges.items():
                fam.add_metric([model], float(st.get(k, 0) or 0))
            for k, fam in counters.items():
                fam.add_metric([model], float(st.get(k, 0) or 0))
            cleanup_ms = float(st.get("cleanup_ms", 0) or 0)
            if st.get("cleanup") == "1":
                cleanup_ms += now - float(st.get("cleanup_since_ms", now))
            cleanup_s.add_metric([model], cleanup_ms / 1000)
            lane_max = float(ov["config"].get("lane_max", 2048))
            active = [s for s in ov["shapes"] if s["state"] in ("active", "draining")]
            used = sum(s["lanes"] for s in active)
            pressure.add_metric([model], used / lane_max if lane_max else 0.0)
            starving.add_metric([model], float(sum(
                1 for s in ov["shapes"] for ln in s.get("lane_rows", [])
                if ln["items"] > 0 and ln["since_ms"] and now - ln["since_ms"] > self.starving_ms)))
        yield from gauges.values()
        yield from counters.values()
        yield from (pressure, starving, cleanup_s)
