"""The benchmarks' quick forms run, and the conductor's results are complete. No timing asserts."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter

import pytest

from bench.common.workload import WorkloadSpec, generate
from bench.packing import suite
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
    p = subprocess.run([sys.executable, "bench/broker/submit_claim.py", "--quick", "--items", "600", "--claims", "10",
                        "--backlog", "500"], cwd=str(ROOT), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    out = p.stdout.decode()
    for label in ("conductor (Conductor.submit", "RQ 2.12.0 enqueue_many", "plain pipelined XADD",
                  "conductor.claim", "XREADGROUP COUNT 64 (floor)"):
        assert label in out


def test_suite_cli_quick_writes_json(tmp_path):
    out = tmp_path / "figs.json"
    p = subprocess.run([sys.executable, "bench/packing/suite.py", "--quick", "--no-write", "--items", "300",
                        "--shapes", "3", "--json", str(out)], cwd=str(ROOT), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    figs = json.loads(out.read_text())
    assert set(figs) == set(suite.SYSTEMS)
    assert "ok: every id exactly once" in p.stdout.decode()


def test_lifecycle_bench_quick_runs_and_loses_nothing():
    from bench.packing.lifecycle_bench import run
    text = run(quick=True)
    assert text.count("Conductor results: ok: every id exactly once.") == 2
    assert "| items left at the end (goal 0) | 0 | 0 |" in text


def test_cluster_claim_bench_runs(capsys):
    from bench.broker import cluster_claim
    assert cluster_claim.main(["--claims", "5"]) == 0
    out = capsys.readouterr().out
    assert "| 3-node cluster |" in out and out.count("| single node") == 2


def test_cluster_shards_bench_runs(capsys):
    from bench.broker import cluster_shards
    assert cluster_shards.main(["--items", "400", "--masters", "3", "--shapes", "12", "--workers", "1",
                                "--idle-s", "0", "--no-write"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | 3 | 12 | least loaded |" in out and "GPUs fed" in out


def test_oracle_plan_covers_every_item_once_in_pure_batches_under_the_contract():
    from bench.common import oracle
    wl = generate(WorkloadSpec(items=3000, shapes=6, seed=4))
    prefixes = suite.oracle_prefixes(wl)
    p = oracle.plan(wl.items, prefixes, 4, 64, 65536, oracle.sim_work())
    ids = [it.id for w in p.workers for b in w for it in b.items]
    assert sorted(ids) == sorted(it.id for it in wl.items)
    for w in p.workers:
        for b in w:
            assert {it.sig for it in b.items} == {b.sig}
            assert len(b.items) <= 64 and len(b.items) * b.plen <= 65536
    # The most popular shape holds more than a quarter of the work: it is split over several workers.
    top = wl.shapes[0].sig
    assert sum(1 for w in p.workers if any(b.sig == top for b in w)) > 1
    # Each worker runs its shapes one after another.
    for w in p.workers:
        sigs = [b.sig for b in w]
        assert len(set(sigs)) == 1 + sum(1 for a, b in zip(sigs, sigs[1:], strict=False) if a != b)


def test_static_cost_model_prices_prefix_reuse_graphs_and_arrival():
    from bench.common import static_cost as sc

    class It:
        def __init__(self, id_: str, tok: int) -> None:
            self.id, self.input_tokens, self.max_tokens = id_, tok, 8
    its = [It("a", 100), It("b", 100), It("c", 100)]
    items = sc.Items(its, [0.0, 0.0, 5.0], {"s": 60})
    p = sc.StaticParams(prefill_per_token=1.0, decode_base=0.0, decode_per_seq=0.0, graph_build=1000.0)
    res = sc.replay([[sc.SBatch(104, [("s", ["a", "b"])]), sc.SBatch(104, [("s", ["c"])])]], items, p)
    # First batch: 2*104 - 60 (prefix for all but the first) + one graph; the second waits for
    # its item (t=5) and has the prefix cached, and reuses the graph.
    assert res.prefill_s == (2 * 104 - 60) + (104 - 60)
    assert res.graphs == 1 and res.wait_s == 0.0
    assert res.makespan == (2 * 104 - 60) + 1000 + (104 - 60)
    late = sc.replay([[sc.SBatch(104, [("s", ["c"])])]], items, p)
    assert late.wait_s == 5.0 and late.makespan == 5.0 + 104 + 1000  # alone, it computes its prefix


def test_sweep_quick_form_runs_every_point_and_the_oracle_beats_the_stream(tmp_path, capsys):
    import math

    from bench.packing import sweep
    out = tmp_path / "sweep.json"
    assert sweep.main(["--quick", "--no-write", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    quick = [p.name for p in sweep.POINTS if p.quick]
    results = json.loads(out.read_text())
    assert [r["point"] for r in results] == quick
    for name in quick:
        assert f"| {name} |" in text
    assert "ok: every id exactly once at every point." in text
    for r in results:
        f = r["systems"]
        for s in ("conductor", "stream"):
            for model in ("sim", "static"):
                assert math.isfinite(f[s][f"ratio_{model}"]) and f[s][f"ratio_{model}"] > 0, (r["point"], s, model)
        assert f["stream"]["ratio_sim"] <= 1.0 and f["stream"]["ratio_static"] <= 1.0, r["point"]
        assert f["conductor"]["complete"].startswith("ok")
        for s in ("oracle", "stream", "conductor"):
            assert f[s]["finished"] == r["spec"]["items"]


def _bench(*args: str, timeout: float = 120) -> str:
    p = subprocess.run([sys.executable, *args], cwd=str(ROOT), capture_output=True, timeout=timeout)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    return p.stdout.decode()


def test_claim_profile_times_the_functions_of_claim_lua_as_loaded(redis_url):
    # The instrumented copy follows claim.lua and its includes (issue 28: the copy that cut the
    # script at text anchors had rotted); the script as is is timed beside it.
    from bench.profiles import claim_profile
    from conductor.client import connect
    from conductor.redis_contract.scripts import source
    res = claim_profile.profile(connect(redis_url), 1500, 12, log=lambda _line: None)
    phases = res["phases"]
    assert claim_profile.WHOLE in phases and res["as_is_us"] > 0
    timed = set(phases) - {claim_profile.WHOLE}
    assert len(timed) >= 5, phases
    assert timed <= set(claim_profile.timed_functions(source("claim")))
    assert phases[claim_profile.WHOLE] >= max(phases[k] for k in timed)
    assert "| function of one claim" in claim_profile.as_markdown(res)


def test_submit_profile_makes_every_copy_it_names(redis_url):
    from bench.profiles import submit_profile
    from conductor.client import connect
    res = submit_profile.profile(connect(redis_url), 1200, 1, 400, shapes=4, log=lambda _line: None)
    assert res["skipped"] == [], f"anchors gone from submit.lua: {res['skipped']}: update CUTS"
    assert set(res["per_item"]) == {"as is", *submit_profile.CUTS}
    assert all(v > 0 for v in res["per_item"].values())


def test_claim_contention_quick_form_runs():
    out = _bench("bench/broker/claim_contention.py", "--workers", "1,2", "--items", "300")
    assert "| 2 |" in out and "server p99 vs 1" in out


def test_disk_tier_quick_form_runs():
    out = _bench("-m", "bench.memory.disk_tier", "--quick", timeout=180)
    assert "store segments (tier)" in out


def test_disk_tier_packing_oracle_per_ceiling_sized_run():
    """The bound issue 37's packing figure prints beside the oracle: a shape seen a ceiling's worth
    at a time is cut run by run, in arrival order."""
    from bench.memory.disk_tier import MODEL, oracle_waste
    from conductor.formats.lines import parse_line
    from conductor.redis_contract.records import PreparedItem

    def item(i: int, tok: int) -> PreparedItem:
        return parse_line(json.dumps({"id": f"i{i}", "model": MODEL, "prefix": ["p"], "prompt": "x",
                                      "input_tokens": tok, "max_tokens": 1}))
    # arrival order long, short, long, short: the whole shape cuts {96, 96} and {200, 200};
    # runs of 300 tokens see {200, 96} twice, each padded to 200
    its = [item(0, 200), item(1, 96), item(2, 200), item(3, 96)]
    assert oracle_waste(its, 2, 10_000) == 0.0
    assert oracle_waste(its, 2, 10_000, window=300) == 208 / 800
    assert oracle_waste(its, 2, 10_000, window=10_000) == 0.0


def test_idle_fleet_quick_form_runs():
    out = _bench("bench/broker/idle_fleet.py", "--fleets", "2", "--seconds", "0.3", "--requests", "10", "--wakes", "2",
                 "--settle-s", "0.5")
    assert "doorbell (BLPOP)" in out and "64 of 64 permits back after" in out


def test_idle_goal_quick_form_runs():
    out = _bench("bench/broker/idle_fleet.py", "--idle-goal", "--fleets", "1,2", "--seconds", "0.5", "--repeats", "1",
                 "--wakes", "2", "--settle-s", "0.5")
    assert "sent/s per worker (not the holder)" in out and "Marginal Redis CPU" in out


def test_idle_sharded_quick_form_runs():
    out = _bench("bench/broker/idle_fleet.py", "--sharded", "--masters", "3", "--fleets", "1", "--seconds", "0.3",
                 "--repeats", "1", "--wakes", "1")
    assert "sent/s per worker (not a holder)" in out and "us/s per idle worker" in out


def test_input_rss_quick_form_runs():
    out = _bench("-m", "bench.intake.input_rss", "--rows", "1500", "--no-write")
    assert "| 1,500 | JSONL |" in out and "| 1,500 | Parquet |" in out


def test_intake_speed_quick_form_runs_every_system():
    # each system's run asserts its own completeness (every item accepted, the API task done)
    out = _bench("-m", "bench.intake.intake_speed", "--quick", "--items", "600")
    for label in ("| xadd |", "| library |", "| submit |", "| submit (process) |", "| xadd (OpenAI) |", "| api |"):
        assert label in out, label


def test_every_benchmark_has_a_quick_form_in_the_tests():
    # A benchmark nothing runs rots (issue 28): each bench/ module with a main is run by a test.
    text = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    missing = []
    for path in sorted((ROOT / "bench").glob("*/*.py")):
        sub, name = path.parent.name, path.stem
        if "def main(" not in path.read_text():
            continue
        if not any(ref in text for ref in (f"bench/{sub}/{name}.py", f"bench.{sub}.{name}",
                                           f"bench.{sub} import {name}")):
            missing.append(f"{sub}/{name}")
    assert not missing, missing


def test_bench_holds_only_its_subpackages():
    # bench/ is split by what each module measures (issue 34): no module at its top but the package's own
    assert sorted(p.name for p in (ROOT / "bench").glob("*.py")) == ["__init__.py"]


def test_fleet_quick_form_joins_drains_and_kills_workers_and_loses_nothing(tmp_path):
    """bench/fleet/fleet.py's quick points: a worker joining mid-run, one drained and one killed (its
    batches reclaimed); every id exactly once (the run exits 1 otherwise)."""
    out = tmp_path / "fleet.json"
    p = subprocess.run([sys.executable, "bench/fleet/fleet.py", "--quick", "--no-write", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    runs = json.loads(out.read_text())
    assert set(runs) == {"q-fleet", "q-leave"}
    for name, rs in runs.items():
        c = rs[0]["conductor"]
        assert c["complete"].startswith("ok") and c["finished"] >= 2000, (name, c["complete"])
        assert rs[0]["ratio_sim"] > 0 and rs[0]["ratio_static"] > 0


def test_returns_counts_a_worker_coming_back_to_an_instance_it_left():
    from bench.fleet.fleet import returns

    class E:
        instances = ["a:1", "a:1", "b:1", "a:1", "c:1", "b:1", "b:1"]
    assert returns(E()) == 2  # back to a:1 once, to b:1 once


def test_fairness_quick_form_runs_every_scenario():
    """bench/fleet/fairness.py's small forms: tenants' shares, a late tenant, interactive requests, deadlines
    and the cost against first-come-first-served; the goals are reported, not asserted."""
    out = _bench("bench/fleet/fairness.py", "--quick", "--no-write", timeout=300)
    for name in ("shares-1:1", "shares-3:1", "late", "interactive", "deadlines", "cost"):
        assert f"| {name} |" in out, out[-2000:]



def test_fairness_seeds_quick_form_reports_a_median_per_weighting():
    """bench/fleet/fairness_seeds.py on one small seed: a gap and A's share for 1:1 and 3:1."""
    out = _bench("bench/fleet/fairness_seeds.py", "--seeds", "1", "--items", "2000", "--engine-seqs", "64",
                 timeout=300)
    for w in ("1:1", "3:1"):
        assert f"engine 64, weights {w}: gap per seed" in out and "median" in out, out[-2000:]

def test_memory_cap_quick_form_drains_both_runs():
    p = subprocess.run([sys.executable, "-m", "bench.memory.memory_cap", "--quick"], cwd=str(ROOT), capture_output=True,
                       timeout=180)
    assert p.returncode == 0, (p.stdout.decode()[-2000:], p.stderr.decode()[-2000:])
    out = p.stdout.decode()
    assert "maxmemory 64mb (noeviction)" in out and "no cap (peer)" in out and "| yes |" in out


def test_redis_cost_quick_form_runs_with_a_before_tree(tmp_path):
    # --before measures another checkout's tree in a child process: here this same tree, copied
    before = tmp_path / "before"
    before.mkdir()
    archive = tmp_path / "head.tar"
    subprocess.run(["git", "archive", "-o", str(archive), "HEAD"], cwd=str(ROOT), check=True)
    subprocess.run(["tar", "-xf", str(archive), "-C", str(before)], check=True)
    out = _bench("bench/broker/redis_cost.py", "--quick", "--reps", "1", "--no-write", "--before", str(before),
                 timeout=240)
    assert "| q2 |" in out and "plain FIFO stream (limit)" in out and "INCOMPLETE" not in out
    for script in ("| claim |", "| complete |", "| submit |"):
        assert script in out


def test_drive_idle_conductor_worker_waits_on_the_doorbell_instead_of_polling():
    # issue 36: an idle Worker.run blocks on the doorbell (workers/idle.py); the drive's "bell" wait
    # models that, so an idle worker's claims (engine empty, answer 'idle') are a few, not one every
    # 2 ms of simulated time; the batches and the results are the same work either way.
    from conductor.client import connect
    from conductor.embedded import EmbeddedRedis
    from conductor.workers.worker import Worker

    wl = generate(WorkloadSpec(items=1500, shapes=6, seed=5))
    counts: dict[str, Counter] = {}
    pull = Worker._pull

    def counted(self):  # noqa: ANN001, ANN202
        idle = self.engine.active() == 0
        got = pull(self)
        if idle and self.last_claim == "idle":
            counts[wake]["idle"] += 1
        return got

    Worker._pull = counted
    try:
        with EmbeddedRedis() as srv:
            for wake in ("poll", "bell"):
                counts[wake] = Counter()
                rec = suite.run_conductor(connect(srv.url), srv.url, wl,
                                          suite.SuiteConfig(workers=2, max_wall_s=60.0, wake=wake))
                assert rec.complete.startswith("ok"), (wake, rec.complete)
                counts[wake]["batches"] = len(rec.batches)
    finally:
        Worker._pull = pull
    assert counts["bell"]["idle"] * 3 < counts["poll"]["idle"], counts
    assert counts["bell"]["batches"] == counts["poll"]["batches"], counts


@pytest.mark.parametrize("script,fn", [("claim", "plan_lane"), ("complete", "write_results"),
                                       ("submit", "choose_lane")])
def test_the_lua_profile_replays_each_script_by_function(script, fn):
    # bench/profiles/claim_lua_profile.py's quick form: a small job's calls of the script replayed in
    # Lua 5.1 (lupa) against a real redis-server, the VM's instructions counted by Lua function
    p = subprocess.run([sys.executable, "bench/profiles/claim_lua_profile.py", "--items", "400", "--workers", "2",
                        "--workload", "w2", "--script", script, "--top", "8"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    m = re.search(rf"(\d+) {script} calls?, ([\d,]+) VM instructions a call", p.stdout)
    assert m and int(m.group(1)) > 0 and int(m.group(2).replace(",", "")) > 1000, p.stdout[-2000:]
    assert re.search(rf"^\s+[\d.]+\s+\d+\s+[\d.]+\s+[\d.]+\s+{fn}:", p.stdout, re.M), p.stdout[-2000:]


@pytest.mark.slow  # about 8 s: redis-server under valgrind
def test_script_instructions_counts_each_script_call_under_callgrind(tmp_path):
    from bench.profiles import script_instructions
    res = script_instructions.measure(300, 2, tmp_path, say=lambda _line: None)
    kinds = res["kinds"]
    assert res["submit"] > 0 and kinds["claim"]["items"] == 300 and kinds["complete"]["items"] == 300
    assert all(v["instructions"] > 0 and v["calls"] > 0 for v in kinds.values()), kinds
    assert "together" in script_instructions.report(res)


def test_holder_sweep_quick_form_runs():
    out = _bench("bench/broker/holder_sweep.py", "--shards", "3", "--consumers", "2", "--seconds", "1.5")
    assert "commands/s, the holder of every part" in out and "lua:lease" in out


def test_real_engine_takes_a_users_file_and_says_what_it_needs(tmp_path):
    """bench/engines/real_engine.py --input: a copy with the bench's model name, never the input rewritten; a line
    without an output limit or without messages refused naming the line; every comparison the cases allow is
    made for it, with no goal (the goals are the generated families')."""
    import json as _json

    from bench.engines.real_engine import MODEL, Case, input_copy, ratios
    src = tmp_path / "batch.jsonl"
    good = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "theirs", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
    src.write_text(_json.dumps(good) + "\n\n")
    work = tmp_path / "w"
    work.mkdir()
    name, copy, n = input_copy(src, work)
    assert (name, n) == ("input-batch", 1) and copy.parent == work
    assert _json.loads(copy.read_text())["body"]["model"] == MODEL
    assert _json.loads(src.read_text().splitlines()[0])["body"]["model"] == "theirs"
    assert input_copy(src, work)[0] == "input-batch-2"  # a second file of that name gets its own copy
    no_limit = dict(good, body={"model": "m", "messages": []})
    src.write_text(_json.dumps(good) + "\n" + _json.dumps(no_limit) + "\n")
    with pytest.raises(SystemExit, match="line 2: body.max_tokens: required"):
        input_copy(src, work)
    src.write_text(_json.dumps({"custom_id": "x", "body": {"prompt": "p", "max_tokens": 2}}) + "\n")
    with pytest.raises(SystemExit, match="line 1: needs custom_id and body.messages"):
        input_copy(src, work)

    def case(name: str, wall: float) -> Case:
        return Case(name, "input-batch", wall, 1, 1, 0, 0, 1, None, "")
    got = {w: (round(r, 2), g) for w, r, g in ratios([case("a", 60), case("b", 30), case("a2 halves", 40),
                                                       case("c", 20), case("d", 30)])}
    assert got == {"(b) over (a), input-batch": (2.0, None), "(c) over two half-file runners, input-batch": (2.0, None),
                   "(d) over (b), input-batch": (1.0, None)}


def test_real_engine_gives_every_engine_the_same_settings_on_a_gpu_too(tmp_path):
    """bench/engines/real_engine.py: vLLM's runner and server and the conductor's engine get the same settings:
    on a CPU eager with the given KV cache (as before), on a GPU vLLM's own memory share unless --kv-mb, and
    --eager on all of them alike (the conductor's engine is not eager on a GPU by itself)."""
    from bench.engines.real_engine import Setup, engine_settings

    def flags(gpu: bool, kv: int | None, eager: bool) -> tuple[list[str], list[str]]:
        s = Setup(tmp_path, tmp_path, gpu, kv, {}, eager=eager)
        return s.engine_flags(), s.conductor_engine_args()

    kv = str(32 << 20)
    assert flags(False, 32 << 20, False) == (["--enforce-eager", "--kv-cache-memory-bytes", kv],
                                              ["--engine-arg", f"kv_cache_memory_bytes={kv}"])
    assert flags(True, None, False) == ([], [])
    assert flags(True, None, True) == (["--enforce-eager"], ["--engine-arg", "enforce_eager=true"])
    small = str(683 << 20)
    assert flags(True, 683 << 20, True) == (["--enforce-eager", "--kv-cache-memory-bytes", small],
                                            ["--engine-arg", "enforce_eager=true",
                                             "--engine-arg", f"kv_cache_memory_bytes={small}"])
    gpu = argparse.Namespace(gpu=True, eager=True)
    assert engine_settings(gpu, None) == ", GPU, enforce_eager, vLLM's own gpu_memory_utilization"
    assert engine_settings(gpu, 683 << 20) == ", GPU, enforce_eager, KV cache 683 MiB on every engine"
    assert engine_settings(argparse.Namespace(gpu=False, eager=False), 32 << 20) == \
        ", CPU, enforce_eager, KV cache 32 MiB on every engine"


def test_holder_sweep_worker_quick_form_runs():
    out = _bench("bench/broker/holder_sweep.py", "--worker", "--shards", "1", "--consumers", "2", "--seconds", "4.5",
                 "--settle", "2")
    assert "commands/s, an idle worker holding every lease" in out and "lua:idle_beat" in out
