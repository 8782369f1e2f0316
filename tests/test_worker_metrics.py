"""The worker's Prometheus figures move with its work: a scrape (generate_latest, the text a
Prometheus server reads) before and after a latched run over a real redis-server."""

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
        seen_active = max(seen_active, now[("conductor_worker_active_slots", ())])
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
    assert after[("conductor_worker_active_slots", ())] == 0
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
    assert after[("conductor_worker_retry_buffer", ())] == 0


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
        assert scrape("wr")[("conductor_worker_retry_buffer", ())] == 1
    finally:
        c.r.config_set("min-replicas-to-write", 0)
    w.turn()
    assert scrape("wr")[("conductor_worker_retry_buffer", ())] == 0
