"""``conductor exporter``: a real process serving the broker's figures from a real redis-server,
scraped over HTTP as Prometheus would; stateless (a second or restarted exporter serves the same)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

from prometheus_client.parser import text_string_to_metric_families

from conductor.embedded import free_port
from conductor.redis_contract.records import Contract
from tests.conftest import ROOT, item
from tests.helpers import quick


def scrape(port: int, timeout: float = 30) -> dict[tuple[str, tuple], float]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@contextmanager
def exporter(url: str, *extra: str):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "conductor", "exporter", "--port", str(port), "--host", "127.0.0.1",
                          *extra], env=dict(os.environ, CONDUCTOR_REDIS_URL=url), cwd=str(ROOT),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield port
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0


def m(**labels: str) -> tuple:
    return tuple(sorted(labels.items()))


def test_the_exporter_serves_every_models_figures_from_redis(redis_url, cdr):
    with exporter(redis_url, "--top-shapes", "1", "--starving-s", "0.05") as port:
        empty = scrape(port)
        assert empty[("conductor_redis_up", ())] == 1
        assert not [k for k in empty if k[0].startswith("conductor_waiting")]  # no model yet, nothing made up

        quick(cdr, max_deliveries=1)
        quick(cdr, "n")
        big = [item(f"a{k}", 40, prefix=("A",)) for k in range(10)]
        small = [item(f"b{k}", 10, prefix=("B",)) for k in range(3)]
        cdr.submit(big + small + [item("x", 7, model="n")], "j1")
        contract = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)
        held, _ = cdr.claim(contract, "alive-worker")
        doomed, _ = cdr.claim(contract, "dead-worker")
        cdr.reclaim_consumer("m", "dead-worker", force=True)  # max_deliveries 1: its items are dead-lettered
        cdr.r.hset("cdr:{m}:workers", "alive-worker", "{}")
        cdr.r.set("cdr:{m}:hb:alive-worker", 1, px=60_000)
        cdr.pause("n")
        time.sleep(0.1)

        got = scrape(port)
        waiting = 13 - len(held.items) - len(doomed.items)
        assert got[("conductor_waiting_items", m(model="m"))] == waiting
        assert got[("conductor_waiting_tokens", m(model="m"))] == int(cdr.r.hget("cdr:{m}:intake", "tokens"))
        assert got[("conductor_waiting_items", m(model="n"))] == 1
        assert got[("conductor_inflight_batches", m(model="m"))] == 1
        assert got[("conductor_inflight_items", m(model="m"))] == len(held.items)
        assert got[("conductor_pending_entries", m(model="m"))] == 1
        assert got[("conductor_consumer_pending_entries", m(model="m", consumer="alive-worker"))] == 1
        assert got[("conductor_dead_letter_items", m(model="m"))] == len(doomed.items)
        assert got[("conductor_dead_lettered_items_total", m(model="m"))] == len(doomed.items)
        assert got[("conductor_workers_alive", m(model="m"))] == 1
        assert got[("conductor_workers_alive", m(model="n"))] == 0
        assert got[("conductor_model_paused", m(model="n"))] == 1 and got[("conductor_model_paused", m(model="m"))] == 0
        assert got[("conductor_lanes_in_use", m(model="m"))] >= 2
        assert 0 < got[("conductor_lane_pressure_ratio", m(model="m"))] <= 1
        assert got[("conductor_starving_lanes", m(model="m"))] >= 1
        # the largest shape only (--top-shapes 1): the one with the most waiting tokens
        shapes = {k: v for k, v in got.items() if k[0] == "conductor_shape_waiting_tokens" and ("model", "m") in k[1]}
        assert len(shapes) == 1
        assert list(shapes.values())[0] == max(
            int(cdr.r.hget(f"cdr:{{m}}:inst:{i.decode()}", "tokens")) for i in
            cdr.r.zrange("cdr:{m}:staged", 0, -1) + cdr.r.zrange("cdr:{m}:active", 0, -1))
        # per running job, over its models
        assert got[("conductor_job_items", m(job="j1", status="submitted"))] == 14
        assert got[("conductor_job_items", m(job="j1", status="failed"))] == len(doomed.items)
        assert got[("conductor_job_items", m(job="j1", status="pending"))] == 14 - len(doomed.items)

        # stateless: another exporter, started now, serves the same figures
        with exporter(redis_url, "--top-shapes", "1", "--starving-s", "0.05") as other:
            again = scrape(other)
        same = [k for k in got if k[0] in ("conductor_waiting_tokens", "conductor_inflight_items",
                                           "conductor_job_items", "conductor_workers_alive")]
        assert same and all(again[k] == got[k] for k in same)


def test_a_finished_job_leaves_the_per_job_series(redis_url, cdr):
    from tests.helpers import drain
    quick(cdr)
    cdr.submit([item("a", 10)], "done-job")
    drain(cdr, Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096))
    with exporter(redis_url) as port:
        got = scrape(port)
    assert not [k for k in got if k[0] == "conductor_job_items"]
    assert got[("conductor_completed_items_total", m(model="m"))] == 1


def test_without_redis_the_exporter_answers_redis_up_0():
    with exporter(f"redis://127.0.0.1:{free_port()}/0") as port:
        got = scrape(port, timeout=60)
        t0 = time.monotonic()
        again = scrape(port, timeout=60)
        took = time.monotonic() - t0
    assert got == again == {("conductor_redis_up", ()): 0}
    # within Prometheus's default scrape timeout (10 s) with room for a busy machine: before, each
    # scrape waited out a worker's whole reconnect backoff (about 9 s)
    assert took < 5, took
