"""The drift gauge: the periodic check's result as a metric per kind of counter, and one critical
log line when any counter differs."""

from __future__ import annotations

import json
import logging

import redis

from conductor.verify.checks import Report, verify_confirmed
from conductor.verify.snapshot import EXAMPLES

log = logging.getLogger("conductor.verify")


_published: dict[str, set[str]] = {}


def publish_drift(report: Report) -> None:
    """Set the drift gauge per (model, kind of counter); one critical log line when any differs."""
    from conductor.observability import metrics

    kinds = report.by_kind()
    for kind in _published.get(report.model, set()) - set(kinds):
        metrics.DRIFT.labels(report.model, kind).set(0)
    for kind, v in kinds.items():
        metrics.DRIFT.labels(report.model, kind).set(v)
    _published[report.model] = set(kinds)
    if not report.ok:
        log.critical(json.dumps({
            "event": "counter_drift", "model": report.model, "differ": len(report.drift),
            "kinds": {k: v for k, v in kinds.items() if v},
            "rows": [[x.key, x.field, x.recorded, x.truth] for x in report.drift[:EXAMPLES]],
            "problems": report.problems[:EXAMPLES],
            "fix": f"conductor inspect {report.model} --verify --repair"}))


def watch_drift(r: redis.Redis, model: str, *, pause_s: float = 0.5) -> Report:
    """The periodic check (maintenance lease holder): counters only, confirmed by a second pass."""
    report = verify_confirmed(r, model, items=False, pause_s=pause_s)
    publish_drift(report)
    return report
