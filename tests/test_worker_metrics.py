"""The worker's Prometheus figures move with its work: a scrape (generate_latest, the text a
Prometheus server reads) before and after a latched run over a real redis-server."""

import time

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import item
from tests.helpers import quick
from tests.worker_kit import run_until_done, sim, worker

MODEL = "metrics-model"


def scrape(worker: str = "wm") -> dict[tuple[str, tuple], float]:
    """This model's samples, and of per-worker ones only ``worker``'s."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if s.labels.get("model") == MODEL and s.labels.get("worker", worker) == worker:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "worker"))))] \
                    = s.value
    return out


def test_a_scrape_shows_the_worker_figures_moving(cdr):
    quick(cdr, MODEL)
    cdr.submit([item(f"a{k}", 10 + k % 5, model=MODEL, prefix=("A",), max_tokens=24) for k in range(24)]
               + [item(f"b{k}", 30, model=MODEL, prefix=("B",), max_tokens=24) for k in range(24)], "j")
    w = worker(cdr, sim(MODEL), name="wm", high_water=8, low_water=2)
    before = scrape()
    seen_active = seen_gated = 0.0
    for _ in range(2000):
        w.turn()
        now = scrape()
        seen_active = max(seen_active, now[("conductor_worker_active_sequences", ())])
        seen_gated = max(seen_gated, now[("conductor_worker_latch_gated", ())])
        if cdr.status("j")["done"] and not w.engine.active():
            break
    run_until_done(w)
    after = scrape()

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("conductor_finished_sequences_total") == 48
    assert delta("conductor_output_tokens_total") == w.output_tokens > 48
    assert seen_active == 8 and seen_gated == 1
    assert after[("conductor_worker_active_sequences", ())] == 0
    assert delta("conductor_worker_latch_transitions_total") == w.latch.transitions >= 2
    assert delta("conductor_batch_items_count") == w.batches_claimed
    assert delta("conductor_batch_items_sum") == 48
    actual = sum(10 + k % 5 for k in range(24)) + 24 * 30
    assert delta("conductor_actual_tokens_total") == actual
    assert delta("conductor_padded_tokens_total") > actual  # the A lane pads 10..14 to 16
    assert delta("conductor_batch_fill_ratio_count") == w.batches_claimed
    assert 0 < delta("conductor_batch_fill_ratio_sum") < w.batches_claimed
    assert delta("conductor_engine_step_seconds_count") == w.engine.counters.steps
    assert delta("conductor_worker_shape_switches_total") >= 1  # two shapes, one worker
    assert after[("conductor_worker_retry_buffer_batches", ())] == 0


def test_retry_buffer_depth_shows_while_redis_refuses_writes(fresh_server):
    from conductor.client import Conductor, connect
    c = Conductor(connect(fresh_server.url))
    quick(c, MODEL)
    c.submit([item(f"r{k}", 10, model=MODEL, max_tokens=4) for k in range(4)], "j")
    w = worker(c, sim(MODEL), name="wr")
    w.turn()
    c.r.config_set("min-replicas-to-write", 1)
    try:
        for _ in range(6):
            w.turn()
        assert scrape("wr")[("conductor_worker_retry_buffer_batches", ())] == 1
    finally:
        c.r.config_set("min-replicas-to-write", 0)
    w.turn()
    assert scrape("wr")[("conductor_worker_retry_buffer_batches", ())] == 0


def test_every_worker_series_names_its_worker_and_gauges_their_unit(cdr):
    from conductor.workers.maintenance import Maintenance
    quick(cdr, MODEL)
    cdr.submit([item(f"u{k}", 10, model=MODEL, prefix=(f"S{k % 3}",), max_tokens=4) for k in range(24)], "j")
    maint = Maintenance(cdr, MODEL, "labelled", interval_s=0, verify_interval_s=3600)
    maint.tick()  # positions its cursor on the finished-shapes stream
    w = worker(cdr, sim(MODEL), name="labelled")
    run_until_done(w)
    maint._verify_next = 0.0
    maint._next = 0.0
    maint.tick()  # the thrash alarm, batches per shape and the drift check: the lease holder's series
    maint.verify_thread.join(30)
    fams = [f for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())
            if f.name.startswith("conductor_")]
    ours = [s for f in fams for s in f.samples if s.labels.get("model") == MODEL]
    names = {s.name for s in ours}
    assert {"conductor_batch_fill_ratio_bucket", "conductor_padded_tokens_total", "conductor_actual_tokens_total",
            "conductor_batches_per_shape_count", "conductor_counter_drift", "conductor_claim_seconds_count",
            "conductor_prefix_hit_tokens_total"} <= names
    unlabelled = sorted({s.name for s in ours if not s.labels.get("worker")})
    assert not unlabelled, f"series without a worker label: {unlabelled}"
    assert {s.labels["worker"] for s in ours if s.name == "conductor_counter_drift"} == {"labelled"}
    units = ("_sequences", "_batches", "_ratio", "_tokens", "_items", "_seconds", "_lanes", "_entries")
    flags = {"conductor_worker_latch_gated", "conductor_feed_stalled"}  # 0 or 1: a state, no unit
    kinds = {"conductor_counter_drift"}  # counts in the unit of its counter label (tokens, items, batches)
    # the text format shows a counter's or histogram's creation time as a gauge of its own
    gauges = {f.name for f in fams if f.type == "gauge" and not f.name.endswith("_created")}
    assert gauges and all(g.endswith(units) or g in flags | kinds for g in gauges), sorted(gauges)


def test_idle_time_while_work_waits_is_counted_apart_from_busy_time(cdr):
    # two items of a shape staged until it holds ten batches or intake goes quiet, which it does
    # not (10 minutes): claims answer 'wait'
    cdr.set_config(MODEL, {"quiet_ms": 600_000, "release_batches": 0, "activate_batches": 10})
    cdr.submit([item(f"w{k}", 10, model=MODEL, prefix=("W",), max_tokens=8) for k in range(2)], "j")
    w = worker(cdr, sim(MODEL), name="wi")
    before = scrape("wi")
    w.turn()
    assert w.last_claim == "wait" and not w.engine.active()
    time.sleep(0.3)
    w.turn()
    after = scrape("wi")
    waited = after[("conductor_worker_idle_with_work_seconds_total", ())] - \
        before.get(("conductor_worker_idle_with_work_seconds_total", ()), 0.0)
    assert waited >= 0.3
    assert after[("conductor_worker_busy_seconds_total", ())] == 0 == w.metrics.busy_s


def test_busy_time_and_warm_claims_of_a_run_over_two_shapes(cdr):
    quick(cdr, MODEL)
    cdr.submit([item(f"a{k}", 10, model=MODEL, prefix=("A",), max_tokens=8) for k in range(16)]
               + [item(f"b{k}", 30, model=MODEL, prefix=("B",), max_tokens=8) for k in range(16)], "j")
    w = worker(cdr, sim(MODEL, time_scale=1.0), name="wc")
    before = scrape("wc")
    run_until_done(w)
    w.turn()  # the turn after the last step closes the busy time
    after = scrape("wc")

    def delta(name):
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    claims = w.batches_claimed
    warm, switches = delta("conductor_worker_warm_claims_total"), delta("conductor_worker_shape_switches_total")
    assert claims >= 8 and warm >= 1 and switches >= 1
    assert warm + switches == claims - 1  # every claim after the first is one or the other
    assert after[("conductor_worker_warm_claim_ratio", ())] == warm / claims
    # sim steps of 8 decode tokens over 8 batches: busy time a few tens of ms at least
    assert 0.01 < delta("conductor_worker_busy_seconds_total") == w.metrics.busy_s
