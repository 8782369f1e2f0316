"""The drift gauge and its critical log line, fed by the maintenance lease holder's periodic check."""

from __future__ import annotations

import json
import logging

from prometheus_client import REGISTRY

from conductor.redis_contract import keys as K
from conductor.verify import repair
from conductor.workers.maintenance import Maintenance
from tests.conftest import item
from tests.helpers import quick


def _gauge(model: str, kind: str) -> float | None:
    return REGISTRY.get_sample_value("conductor_counter_drift", {"model": model, "counter": kind, "worker": "owner-1"})


def _check(m: Maintenance) -> None:
    m._next = 0.0
    m._verify_next = 0.0
    m.tick()
    assert m.verify_thread is not None
    m.verify_thread.join(30)
    assert not m.verify_thread.is_alive()


def test_drift_gauge_and_critical_line_follow_the_truth(cdr, caplog):
    quick(cdr, model="dm")
    cdr.submit([item(i, 10 + i, model="dm", prefix=(f"s{i % 2}",)) for i in range(30)], "dj")
    m = Maintenance(cdr, "dm", "owner-1", verify_interval_s=3600)
    assert m.verify_interval_s == 3600
    with caplog.at_level(logging.CRITICAL, logger="conductor.verify"):
        _check(m)
    assert _gauge("dm", "state.tokens") == 0 and _gauge("dm", "lane.items") == 0
    assert not [r for r in caplog.records if r.levelno == logging.CRITICAL]

    mk = K.ModelKeys("dm")
    cdr.r.hincrby(mk.intake, "tokens", -42)
    cdr.r.hincrby(mk.job_intake("dj"), "submitted", 2)
    caplog.clear()
    with caplog.at_level(logging.CRITICAL, logger="conductor.verify"):
        _check(m)
    assert _gauge("dm", "state.tokens") == 42 and _gauge("dm", "job.submitted") == 2
    assert _gauge("dm", "inst.tokens") == 0
    crit = [json.loads(r.getMessage()) for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(crit) == 1 and crit[0]["event"] == "counter_drift" and crit[0]["model"] == "dm"
    assert [mk.intake, "tokens", int(cdr.r.hget(mk.intake, "tokens")), int(cdr.r.hget(mk.intake, "tokens")) + 42] \
        in crit[0]["rows"]
    assert "--repair" in crit[0]["fix"]

    changes, failed = repair(cdr.r, "dm")
    assert not failed
    assert {(c.key, c.field) for c in changes} == {(mk.intake, "tokens"), (mk.job_intake("dj"), "submitted")}
    _check(m)
    assert _gauge("dm", "state.tokens") == 0 and _gauge("dm", "job.submitted") == 0


def test_only_the_lease_holder_checks_and_zero_turns_it_off(cdr):
    quick(cdr, model="dm2")
    cdr.submit([item(1, 10, model="dm2")], "dj")
    holder = Maintenance(cdr, "dm2", "a", verify_interval_s=3600)
    other = Maintenance(cdr, "dm2", "b", verify_interval_s=3600)
    _check(holder)
    other._next = other._verify_next = 0.0
    other.tick()
    assert other.verify_thread is None
    off = Maintenance(cdr, "dm2", "a", verify_interval_s=0)
    off._next = 0.0
    off.tick()
    assert off.verify_thread is None
