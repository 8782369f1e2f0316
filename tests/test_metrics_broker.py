"""Broker-side Prometheus figures read from Redis at scrape time."""

import time

from prometheus_client import CollectorRegistry, generate_latest

from conductor.observability.broker_metrics import ModelStateCollector
from conductor.redis_contract.records import Contract
from tests.conftest import item
from tests.helpers import MK, drain
from tests.worker_kit import sim, worker


def scrape(c, **kw):
    reg = CollectorRegistry()
    reg.register(ModelStateCollector(c, **kw))
    text = generate_latest(reg).decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("conductor_") and 'model="m"' in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name] = value
    return out


def test_waiting_cleanup_pressure_and_starving_lanes_are_scraped(cdr):
    cdr.set_config("m", {"quiet_ms": 100, "lane_max": 8, "lane_depth": 0, "budget_tokens": 8192, "budget_items": 64,
                         "activate_batches": 4, "release_batches": 0})
    cdr.submit([item(i, 10 + 200 * (i % 4)) for i in range(12)], "j")
    m = scrape(cdr, starving_s=0.05)
    assert m["conductor_waiting_items"] == 12
    assert m["conductor_waiting_tokens"] == sum(10 + 200 * (i % 4) for i in range(12))
    assert m["conductor_cleanup_entries_total"] == 0
    time.sleep(0.15)
    c = Contract(model="m", max_batch_size=2, max_batch_tokens=8192, max_input_len=4096)
    b, _ = cdr.claim(c, "w")  # intake quiet, nothing full: cleanup mode dispatches a partial batch
    assert b.cleanup
    m = scrape(cdr, starving_s=0.05)
    assert m["conductor_cleanup_entries_total"] == 1
    assert m["conductor_cleanup_active"] == 1
    assert m["conductor_lane_pressure_ratio"] == 4 / 8  # four lanes of the active shape, budget eight
    assert m["conductor_starving_lanes"] >= 3  # lanes whose items waited past the (tiny) limit
    assert m["conductor_inflight_items"] == 2
    drain(cdr, c)
    m = scrape(cdr, starving_s=0.05)
    assert m["conductor_waiting_items"] == 0 and m["conductor_cleanup_active"] == 0
    assert m["conductor_cleanup_items_total"] == 12 and m["conductor_cleanup_seconds_total"] > 0


def test_a_paused_model_is_scraped_as_paused(cdr):
    cdr.ensure_model("m")
    assert scrape(cdr)["conductor_model_paused"] == 0
    cdr.pause("m")
    assert scrape(cdr)["conductor_model_paused"] == 1
    cdr.resume("m")
    assert scrape(cdr)["conductor_model_paused"] == 0


def test_the_fleet_balance_is_busy_max_over_mean_of_the_live_workers(cdr):
    """Each worker publishes its busy time with its heartbeat (lua/heartbeat.lua); the exporter
    reads those of the live workers only."""
    w1, w2 = worker(cdr, sim("m"), name="b1"), worker(cdr, sim("m"), name="b2")
    assert scrape(cdr)["conductor_fleet_balance_ratio"] == 1.0  # nobody busy yet
    w1.metrics.busy_s, w2.metrics.busy_s = 3.0, 1.0
    w1._beat()
    w2._beat()
    assert cdr.r.hget(MK.busy, "b1") == b"3000"
    assert scrape(cdr)["conductor_fleet_balance_ratio"] == 3.0 / 2.0
    cdr.r.hset(MK.workers, "gone", "{}")
    cdr.r.hset(MK.busy, "gone", 99_000)  # registered, busy, but its heartbeat expired: not counted
    assert scrape(cdr)["conductor_fleet_balance_ratio"] == 3.0 / 2.0
    w2.deregister()
    assert not cdr.r.hexists(MK.busy, "b2")
    assert scrape(cdr)["conductor_fleet_balance_ratio"] == 1.0
