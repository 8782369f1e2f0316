"""The benchmarks' quick forms run, and the conductor's results are complete. No timing asserts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

from bench import suite
from bench.workload import WorkloadSpec, generate
from tests.conftest import ROOT


def test_workload_is_seeded_and_shaped():
    a = generate(WorkloadSpec(items=300, shapes=5, seed=3))
    b = generate(WorkloadSpec(items=300, shapes=5, seed=3))
    assert [(i.id, i.sig, i.input_tokens) for i in a.items] == [(i.id, i.sig, i.input_tokens) for i in b.items]
    assert len({i.id for i in a.items}) == 300
    for s in a.shapes:
        assert 200 <= s.prefix_tokens <= 3000
    # Zipf: the first shape is the most popular.
    counts = Counter(i.sig for i in a.items)
    assert counts[a.shapes[0].sig] == max(counts.values())
    trickle = generate(WorkloadSpec(items=10, shapes=2, arrival="trickle", rate=100.0))
    assert trickle.arrival_s == sorted(trickle.arrival_s) and trickle.arrival_s[-1] > 0


def test_suite_quick_form_runs_every_system_and_the_conductor_is_complete():
    spec = WorkloadSpec(items=400, shapes=4, seed=5)
    cfg = suite.SuiteConfig(workers=2, max_wall_s=60.0)
    recs, figs, _ = suite.run_suite(spec, cfg, log=lambda _line: None)
    assert set(recs) == set(suite.SYSTEMS)
    assert recs["conductor"].complete.startswith("ok"), recs["conductor"].complete
    for name, f in figs.items():
        assert f["finished"] == 400, name
    # FIFO peers see the same items in the same order: the same batches.
    assert figs["rq"]["batches"] == figs["stream"]["batches"]


def test_suite_trickle_arrival_completes():
    spec = WorkloadSpec(items=300, shapes=3, seed=9, arrival="trickle", rate=3000.0)
    recs, figs, _ = suite.run_suite(spec, suite.SuiteConfig(workers=2, max_wall_s=60.0),
                                    systems=("stream", "conductor"), log=lambda _line: None)
    assert recs["conductor"].complete.startswith("ok"), recs["conductor"].complete
    assert figs["stream"]["finished"] == 300


def test_submit_claim_quick_form_runs(tmp_path):
    p = subprocess.run([sys.executable, "bench/submit_claim.py", "--quick", "--items", "600", "--claims", "10",
                        "--backlog", "500"], cwd=str(ROOT), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    out = p.stdout.decode()
    for label in ("conductor (Conductor.submit", "RQ 2.12.0 enqueue_many", "plain pipelined XADD",
                  "conductor.claim", "XREADGROUP COUNT 64 (floor)"):
        assert label in out


def test_suite_cli_quick_writes_json(tmp_path):
    out = tmp_path / "figs.json"
    p = subprocess.run([sys.executable, "bench/suite.py", "--quick", "--no-write", "--items", "300", "--shapes", "3",
                        "--json", str(out)], cwd=str(ROOT), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    figs = json.loads(out.read_text())
    assert set(figs) == set(suite.SYSTEMS)
    assert "ok: every id exactly once" in p.stdout.decode()


def test_lifecycle_bench_quick_runs_and_loses_nothing():
    from bench.lifecycle_bench import run
    text = run(quick=True)
    assert text.count("Conductor results: ok: every id exactly once.") == 2
    assert "| items left at the end (goal 0) | 0 | 0 |" in text


def test_cluster_claim_bench_runs(capsys):
    from bench import cluster_claim
    assert cluster_claim.main(["--claims", "5"]) == 0
    out = capsys.readouterr().out
    assert "| 3-node cluster |" in out and out.count("| single node") == 2
