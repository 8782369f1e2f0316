"""The admission latch (seed 000): both-or-neither, gating at high water, decodes only while
gated, resume at low water. A real Worker and SimEngine on a real redis-server, driven turn by
turn so every assertion is about one known state."""

import json

import pytest

from conductor.redis_contract import keys as K
from conductor.workers.latch import AdmissionLatch, LatchConfigError
from conductor.workers.worker import Worker, WorkerOptions
from tests.conftest import cli
from tests.worker_kit import run_until_done, sim, submit, worker


def unbounded():
    """A sim engine that runs whatever it is given at once (max_num_seqs 0, seed 000's engine): the
    latch alone bounds what the worker pulls. The default sim runs its batch and asks for about one
    batch beyond (test_a_sim_engine_paces_the_worker_without_a_latch)."""
    return sim(max_num_seqs=0)


@pytest.mark.parametrize("high,low", [(8, None), (None, 2)])
def test_one_threshold_alone_is_refused(high, low):
    with pytest.raises(LatchConfigError, match="--high-water and --low-water go together"):
        AdmissionLatch(high, low)


def test_low_water_must_be_below_high_water():
    with pytest.raises(LatchConfigError, match=r"--low-water \(8\) must be below --high-water \(8\)"):
        AdmissionLatch(8, 8)


def test_worker_refuses_half_a_policy_before_touching_redis(cdr):
    with pytest.raises(LatchConfigError):
        Worker(cdr, sim(), WorkerOptions(name="w1", high_water=8))
    assert cdr.r.hgetall(K.ModelKeys("m").workers) == {}


def test_cli_refuses_half_a_policy_with_a_clear_error(redis_url):
    p = cli("worker", "--engine", "sim", "--model", "m", "--high-water", "8", url=redis_url, check=False,
            timeout=30)
    assert p.returncode == 2
    assert "--high-water and --low-water go together" in p.stderr.decode()
    from conductor.client import Conductor
    assert Conductor.from_url(redis_url).r.hgetall(K.ModelKeys("m").workers) == {}


def test_gates_at_high_water_runs_only_decodes_and_resumes_at_low_water(cdr):
    submit(cdr, 80, tokens=10, max_tokens=24)
    w = worker(cdr, unbounded(), high_water=8, low_water=2)
    eng = w.engine
    trace = []  # (active after the turn, gated, batches claimed, prefill tokens so far)
    for _ in range(400):
        w.turn()
        trace.append((eng.active(), w.latch.gated, w.batches_claimed, eng.counters.prefill_tokens))
        if cdr.status("j")["done"]:
            break
    assert cdr.status("j")["done"]
    assert max(a for a, *_ in trace) <= 8  # pulls are bounded by the room under high water
    gated_spans, span = [], []
    for row in trace:
        if row[1]:
            span.append(row)
        elif span:
            gated_spans.append(span)
            span = []
    assert len(gated_spans) >= 3, "the latch never cycled"
    for span in gated_spans:
        # while gated nothing is claimed and nothing is prefilled: decodes only
        assert len({r[2] for r in span}) == 1 and len({r[3] for r in span}) == 1
        assert all(b[0] <= a[0] for a, b in zip(span, span[1:], strict=False))  # active only falls
        assert span[-1][0] > 2  # still gated above low water ...
    for i, row in enumerate(trace[1:], 1):
        if trace[i - 1][1] and not row[1]:
            assert row[0] <= 2 or row[2] > trace[i - 1][2]  # ... resumed at low water, then pulled
    assert w.latch.transitions == 2 * len(gated_spans) - (1 if trace[-1][1] else 0)


def test_gated_worker_claims_nothing_even_with_work_waiting(cdr):
    submit(cdr, 40, tokens=10, max_tokens=64)
    w = worker(cdr, unbounded(), high_water=4, low_water=1)
    while not w.latch.gated:
        w.turn()
    claimed = w.batches_claimed
    waiting_before = cdr.status("j")["pending"]
    for _ in range(10):
        w.turn()
        assert w.latch.gated or w.engine.active() <= 1
    if w.latch.gated:
        assert w.batches_claimed == claimed
    assert cdr.status("j")["pending"] <= waiting_before


def test_without_a_latch_every_slot_is_filled(cdr):
    submit(cdr, 40, tokens=10, max_tokens=64)
    w = worker(cdr, unbounded())
    for _ in range(10):
        w.turn()
    assert w.engine.active() == 40  # ten pulls of four, nothing finished yet (outputs >= 16 tokens)
    run_until_done(w)
    rows = [json.loads(r) for r in cdr.results("j")]
    assert len(rows) == 40 and {r["id"] for r in rows} == {f"i{k:04d}" for k in range(40)}


def test_a_sim_engine_paces_the_worker_without_a_latch(cdr):
    """The default sim runs its batch (4) at once and asks for another only while fewer than half a
    batch wait to start: the worker holds about one batch beyond what runs, the rest waits in Redis."""
    submit(cdr, 40, tokens=10, max_tokens=64)
    w = worker(cdr)
    most = 0
    for _ in range(200):
        w.turn()
        most = max(most, w.engine.active())
        assert len(w.inflight) <= 3
    # running 4, fewer than 2 waiting when it asked, and the batch it got: at most 9 held
    assert 4 < most <= 9 and w.batches_claimed < 10
    run_until_done(w)
    rows = [json.loads(r) for r in cdr.results("j")]
    assert len(rows) == 40 and {r["id"] for r in rows} == {f"i{k:04d}" for k in range(40)}
