"""The broker's figures, read from Redis on every scrape (``conductor exporter`` serves them).

Nothing is kept between scrapes, so any number of exporters may run (or none: the fleet does
not need one) and a restarted one serves the same figures at once. Per model: waiting tokens
and items, the largest shapes' waiting tokens and items, in-flight batches and items, pending
entries (per consumer too), lanes in use, lane pressure, starving lanes, dead letters, live
workers and their balance (busy max/mean, from the busy time each publishes with its heartbeat),
paused, the model's lifetime counters; per active job: submitted, completed, failed,
pending. Drift is the maintenance lease holder's (a worker series, conductor/observability/metrics.py): a
check reads every waiting entry, too much for a scrape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conductor.client import Conductor
from conductor.errors import ConductorError
from conductor.redis_contract import keys as K

log = logging.getLogger("conductor.observability.exporter")

M = ["model"]


class ModelStateCollector(Collector):
    """``source``: a Conductor, or a function that makes one, or None while Redis holds nothing
    yet (the exporter's: it may start before Redis or before anything was submitted; a scrape
    then says redis_up 0, or serves no models, instead of failing)."""

    STATE_GAUGES = {
        "tokens": ("conductor_waiting_tokens", "Input tokens waiting in lanes"),
        "items": ("conductor_waiting_items", "Items waiting in lanes"),
        "inflight_batches": ("conductor_inflight_batches", "Batches claimed and not yet completed"),
        "inflight_items": ("conductor_inflight_items", "Items in claimed batches not yet completed"),
        "reclaimed_items": ("conductor_reclaimed_items", "Items taken back from dead workers, served first"),
        "cleanup": ("conductor_cleanup_active", "1 while the model is in cleanup mode"),
        "paused": ("conductor_model_paused", "1 while the model is paused (conductor pause)"),
    }
    STATE_COUNTERS = {
        "activations": ("conductor_shape_activations", "Shape instances activated (shape switches)"),
        "cleanup_entries": ("conductor_cleanup_entries", "Times the model entered cleanup mode"),
        "cleanup_batches": ("conductor_cleanup_batches", "Batches dispatched in cleanup mode"),
        "cleanup_items": ("conductor_cleanup_items", "Items dispatched in cleanup mode"),
        "dead_lettered": ("conductor_dead_lettered_items", "Items moved to the dead letter"),
        "completed": ("conductor_completed_items", "Items with a result"),
        "failed": ("conductor_failed_items", "Items with an error result"),
    }

    def __init__(self, source: Conductor | Callable[[], Conductor | None], starving_s: float = 30.0,
                 top_shapes: int = 10, jobs: int = 500) -> None:
        self.c: Conductor | None = source if isinstance(source, Conductor) else None
        self._source: Callable[[], Conductor | None] | None = None if isinstance(source, Conductor) else source
        self.starving_ms = starving_s * 1000
        self.top_shapes = top_shapes
        self.jobs = jobs

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("conductor_redis_up", "1 when this scrape read Redis, else 0 (and nothing else)")
        try:
            if self.c is None and self._source is not None:
                self.c = self._source()
            families = self._families(self.c) if self.c is not None else []
        except (redis.RedisError, ConductorError, OSError) as e:
            log.warning("scrape failed: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self, c: Conductor) -> list[Metric]:
        from conductor.client.fleet import live_workers
        from conductor.jobs.job_list import list_jobs
        from conductor.observability.model_view import model_overview

        def gauge(name: str, doc: str, labels: list[str] = M) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        gauges = {k: gauge(n, d) for k, (n, d) in self.STATE_GAUGES.items()}
        counters = {k: CounterMetricFamily(n, d, labels=M) for k, (n, d) in self.STATE_COUNTERS.items()}
        cleanup_s = CounterMetricFamily("conductor_cleanup_seconds", "Time spent in cleanup mode", labels=M)
        pressure = gauge("conductor_lane_pressure_ratio", "Lanes of active shapes over the lane budget (lane_max)")
        starving = gauge("conductor_starving_lanes", f"Lanes whose head item waited over {self.starving_ms / 1000:g} s")
        lanes = gauge("conductor_lanes_in_use", "Lanes holding or open for items, every shape instance")
        pending = gauge("conductor_pending_entries", "Entries in the batches stream's pending list (claimed batches)")
        per_consumer = gauge("conductor_consumer_pending_entries", "Pending entries per consumer",
                             ["model", "consumer"])
        dead = gauge("conductor_dead_letter_items", "Items in the dead letter now (conductor dead-letter list)")
        alive = gauge("conductor_workers_alive", "Registered workers whose heartbeat has not expired")
        balance = gauge("conductor_fleet_balance_ratio", "Busy time of the busiest live worker over the mean of the "
                        "model's live workers, each since it started (1: even); 1 while none was busy yet")
        shape_lbl = ["model", "shape", "epoch", "state"]
        shape_tokens = gauge("conductor_shape_waiting_tokens", f"Waiting tokens of the {self.top_shapes} largest "
                             "shape instances", shape_lbl)
        shape_items = gauge("conductor_shape_waiting_items", f"Waiting items of the {self.top_shapes} largest "
                            "shape instances", shape_lbl)
        now = time.time() * 1000
        for model in c.models():
            ov = model_overview(c, model, lanes=True)
            st = ov["state"]
            for k, fam in gauges.items():
                fam.add_metric([model], _num(st.get(k)))
            for k, cfam in counters.items():
                cfam.add_metric([model], _num(st.get(k)))
            cleanup_ms = _num(st.get("cleanup_ms"))
            if st.get("cleanup") == "1":
                cleanup_ms += now - float(st.get("cleanup_since_ms", now))
            cleanup_s.add_metric([model], cleanup_ms / 1000)
            lane_max = _num(ov["config"].get("lane_max", 2048))
            used = sum(s["lanes"] for s in ov["shapes"] if s["state"] in ("active", "draining"))
            pressure.add_metric([model], used / lane_max if lane_max else 0.0)
            lanes.add_metric([model], float(sum(s["lanes"] for s in ov["shapes"])))
            starving.add_metric([model], float(sum(
                1 for s in ov["shapes"] for ln in s.get("lane_rows", [])
                if ln["items"] > 0 and ln["since_ms"] and now - ln["since_ms"] > self.starving_ms)))
            consumers = ov["consumers"]
            pending.add_metric([model], float(sum(int(row.get("pending", 0)) for row in consumers)))
            for row in consumers:
                per_consumer.add_metric([model, row["name"]], float(row.get("pending", 0)))
            dead.add_metric([model], float(ov["dead_letter"]))
            live = live_workers(c.r, model)
            alive.add_metric([model], float(len(live)))
            if live:
                busy = [_num(b) for b in c.r.hmget(K.ModelKeys(model).busy, live)]
                mean = sum(busy) / len(busy)
                balance.add_metric([model], max(busy) / mean if mean > 0 else 1.0)
            for s in sorted(ov["shapes"], key=lambda s: -s["tokens"])[:self.top_shapes]:
                labels = [model, s["shape"], str(s["epoch"]), s["state"]]
                shape_tokens.add_metric(labels, float(s["tokens"]))
                shape_items.add_metric(labels, float(s["items"]))
        job_items = gauge("conductor_job_items", "Items of each job still running (submitted, completed, failed, "
                          "pending), over its models", ["job", "status"])
        for row in list_jobs(c, limit=self.jobs):
            if row.pending > 0:
                for status in ("submitted", "completed", "failed", "pending"):
                    job_items.add_metric([row.job, status], float(getattr(row, status)))
        return [*gauges.values(), *counters.values(), cleanup_s, pressure, starving, lanes, pending, per_consumer,
                dead, alive, balance, shape_tokens, shape_items, job_items, *_tenant_families(c)]


def _tenant_families(c: Conductor) -> list[Metric]:
    """Per tenant and model (issue 26): served tokens, waiting tokens, the last minute's share, weight."""
    from conductor.jobs.tenants import tenant_rows
    tl = ["model", "tenant"]
    served = CounterMetricFamily("conductor_tenant_served_tokens", "Tokens served to each tenant (its items' "
                                 "results): padded input (kind=in) and output (kind=out)", labels=[*tl, "kind"])
    waiting = GaugeMetricFamily("conductor_tenant_waiting_tokens", "Input tokens of each tenant's items waiting",
                                labels=tl)
    share = GaugeMetricFamily("conductor_tenant_share_ratio", "Each tenant's share of the service (input + "
                              "decode_weight x output tokens) over the last minute", labels=tl)
    weight = GaugeMetricFamily("conductor_tenant_weight", "Each tenant's weight (conductor tenant T --weight W)",
                               labels=tl)
    for model in c.models():
        for t in tenant_rows(c, model):
            served.add_metric([model, t.tenant, "in"], float(t.served_in))
            served.add_metric([model, t.tenant, "out"], float(t.served_out))
            waiting.add_metric([model, t.tenant], float(t.waiting_tokens))
            share.add_metric([model, t.tenant], t.share_last_minute)
            weight.add_metric([model, t.tenant], t.weight)
    return [served, waiting, share, weight]


def _num(v: Any) -> float:
    try:
        return float(v or 0)
    except ValueError:
        return 0.0
