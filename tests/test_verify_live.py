"""verify() against a live system: scripts run between its reads.

Small instances, the in-flight set and small jobs are read in one MULTI each, so their rows
must agree in every single pass however the scripts interleave; only rows that sum over keys
found by an earlier SCAN (a shape instance or job born during the pass) may differ for a moment.
A repair under the same traffic changes nothing.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from conductor.client import Conductor, connect
from conductor.redis_contract.records import Contract
from conductor.verify import repair, verify, verify_confirmed
from tests.conftest import item
from tests.helpers import quick, results_for

MODEL = "live"
SNAPSHOT_KINDS = ("lane.", "lanes.", "fill.", "ready.", "free.", "inst.", "staged.", "job.",
                  "state.inflight_batches", "state.inflight_items", "state.reclaimed_items", "batches.")


def _traffic(url: str, stop: threading.Event, errors: list[BaseException]) -> None:
    rng = random.Random(7)
    c = Conductor(connect(url))
    contract = Contract(model=MODEL, max_batch_size=8, max_batch_tokens=1024, max_input_len=4096)
    n = 0
    try:
        while not stop.is_set():
            its = []
            for _ in range(rng.randint(1, 20)):
                n += 1
                its.append(item(f"x{n}", rng.randint(5, 300), model=MODEL, prefix=(f"s{rng.randint(0, 3)}",)))
            c.submit(its, f"job{rng.randint(0, 2)}")
            for _ in range(rng.randint(0, 4)):
                w = f"w{rng.randint(0, 1)}"
                b, _why = c.claim(contract, w)
                if b is None:
                    break
                roll = rng.random()
                if roll < 0.1:
                    c.fail(b, w, "boom")  # back to the reclaimed queue, served first
                elif roll < 0.2:
                    c.reclaim_consumer(MODEL, w, force=True)  # a draining worker hands back
                else:
                    c.complete(b, results_for(b)[: len(b.items) // 2], final=False)
                    c.complete(b, results_for(b))
    except BaseException as e:  # noqa: BLE001 - reported by the test thread
        errors.append(e)
    finally:
        c.r.close()


def test_snapshot_rows_agree_in_every_pass_under_traffic(cdr, redis_url):
    quick(cdr, model=MODEL, budget_tokens=1024, budget_items=8, quiet_ms=20, lane_quiet_ms=20)
    stop, errors = threading.Event(), []
    t = threading.Thread(target=_traffic, args=(redis_url, stop, errors), daemon=True)
    t.start()
    passes, transient = 0, 0
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            rep = verify(cdr.r, MODEL, items=False)
            passes += 1
            bad = [(r.key, r.field, r.recorded, r.truth) for r in rep.drift if r.kind.startswith(SNAPSHOT_KINDS)]
            assert not bad, bad
            transient += len(rep.drift)
            if passes % 3 == 0:
                # Repair under traffic must never "fix" a correct counter: instances are
                # recomputed inside one script, model totals only when no script ran meanwhile.
                changes, _busy = repair(cdr.r, MODEL)
                assert changes == [], changes
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert passes >= 3, (passes, transient)
    rep = verify_confirmed(cdr.r, MODEL, items=True)
    assert rep.ok, [(r.key, r.field, r.recorded, r.truth) for r in rep.drift] + rep.problems
    assert rep.ledger["submitted"] > 100


@pytest.mark.soak
def test_worker_processes_and_steady_intake_show_no_confirmed_drift(redis_url, tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT
    c = Conductor(connect(redis_url))
    c.set_config(MODEL, {"quiet_ms": 100})
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url)
    procs = [subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine",
                               "sim", "--model", MODEL, "--name", f"w{i}", "--max-batch-size", "32",
                               "--max-batch-tokens", "4096"], env=env, cwd=str(ROOT)) for i in range(2)]
    try:
        deadline, k = time.monotonic() + 30, 0
        while time.monotonic() < deadline:
            c.submit([item(f"i{k}-{j}", 20 + (j * 37) % 400, model=MODEL, prefix=(f"s{(k + j) % 7}",))
                      for j in range(200)], f"job{k % 3}")
            k += 1
            rep = verify_confirmed(c.r, MODEL, pause_s=0.1)
            assert rep.ok, [(r.key, r.field, r.recorded, r.truth) for r in rep.drift]
        while int(c.r.hget(f"cdr:{{{MODEL}}}:intake", "items") or 0) or \
                int(c.r.hget(f"cdr:{{{MODEL}}}:state", "inflight_items") or 0):
            assert time.monotonic() < deadline + 120
            time.sleep(0.2)
        rep = verify(c.r, MODEL, items=True)
        assert rep.ok and rep.ledger["done"] == rep.ledger["submitted"] == k * 200
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
