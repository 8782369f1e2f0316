"""Issue 36: the Redis cost of an item. The server's CPU per item (submit, claim and complete together) over
a whole job, at 2, 16 and 32 workers on one shard, beside a plain FIFO stream (the limit: raw Redis commands,
no script) and RQ (the peer), measured in the same run.

    .venv/bin/python bench/broker/redis_cost.py                        # every point; rewrites its RESULTS.md section
    .venv/bin/python bench/broker/redis_cost.py --quick --no-write     # one small point, seconds (tests run it)
    .venv/bin/python bench/broker/redis_cost.py --before /tmp/main     # also another checkout's tree, same run

Each point runs bench/packing/suite.py's machinery: the real ``Worker`` loop on the real Lua scripts, sim engines
at time scale 0 (no engine wait: Redis's work is all that is timed), a backlog submitted as one sealed job.
Figures: INFO cpu (used_cpu_user + used_cpu_sys) over submit and run, per item; INFO commandstats deltas (every
command, those scripts run included: which commands inside the scripts cost most); and per script its calls and
server time, read from SLOWLOG with a threshold of 0 in one extra profiled run per point (on Redis 7.0 SLOWLOG logs
the commands a script runs too, each inside its script's time; logging every command costs the server, so the
profiled run's CPU is kept out of the medians). ``--before DIR`` runs this same
file in a child process against DIR's ``conductor`` package, Lua scripts and benchmark machinery (DIR: a checkout
of another commit, e.g. ``git archive main | tar -x -C DIR``), one run before each run of this tree, so both
columns share the machine's load run by run; this tree's runs then go through a child process too, each on a
fresh redis-server as the before runs are (a server kept across runs, the profiled run's and the peers'
included, had cost this tree's runs up to a tenth more).
Medians over ``--reps`` runs; the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_TREE = os.environ.get("CONDUCTOR_COST_TREE")


def _use_tree(tree: str) -> None:
    """Import conductor (and its Lua, workers, migrations) and bench from another checkout: the editable
    install's finder maps those packages to this checkout by absolute path, so its map is rewritten."""
    sys.path.insert(0, tree)
    for finder in sys.meta_path:
        mod = sys.modules.get(getattr(finder, "__module__", ""))
        mapping = getattr(mod, "MAPPING", None)
        if isinstance(mapping, dict) and "conductor" in mapping:
            home = str(Path(mapping["conductor"]).parent)
            for k, v in list(mapping.items()):
                mapping[k] = tree + v[len(home) :] if v.startswith(home) else v


if _TREE:
    _use_tree(_TREE)
elif __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.common.report import command_line, git_rev, machine, now_utc, publish, table  # noqa: E402
from bench.common.workload import WorkloadSpec, generate  # noqa: E402
from bench.packing import suite  # noqa: E402
from conductor.client import connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract import scripts as S  # noqa: E402


@dataclass(frozen=True)
class CostPoint:
    name: str
    varies: str
    spec: WorkloadSpec
    workers: int
    quick: bool = False


_BASE: dict[str, Any] = {"zipf_s": 1.1, "prefix_min": 200, "prefix_max": 3000, "suffix_sigma": 0.7}
# The workloads of the last landing's figures: bench/packing/sweep.py's ref-2w, bench/fleet/fleet.py's f16, f32.
POINTS = [
    CostPoint(
        "w2",
        "2 workers, 12k items, 30 shapes (sweep ref-2w)",
        WorkloadSpec(seed=11, items=12_000, shapes=30, **_BASE),
        2,
    ),
    CostPoint(
        "w16", "16 workers, 24k items, 120 shapes (fleet f16)", WorkloadSpec(seed=103, items=24_000, shapes=120), 16
    ),
    CostPoint(
        "w32", "32 workers, 48k items, 120 shapes (fleet f32)", WorkloadSpec(seed=104, items=48_000, shapes=120), 32
    ),
    CostPoint(
        "q2", "quick: 2 workers, 1,500 items, 6 shapes", WorkloadSpec(seed=5, items=1500, shapes=6), 2, quick=True
    ),
]
BY_NAME = {p.name: p for p in POINTS}
# The last landing's figures (bench/RESULTS.md, fleet section, 2026-12-02, commit 9a3a061).
LANDED = {"w2": 54.5, "w16": 138.0, "w32": 120.1}


def _cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _cmdstats(r: redis.Redis) -> dict[str, tuple[int, int]]:
    out = {}
    for k, v in r.info("commandstats").items():
        out[k.removeprefix("cmdstat_")] = (int(v["calls"]), int(v["usec"]))
    return out


def _script_names() -> dict[str, str]:
    return {hashlib.sha1(S.source(n).encode()).hexdigest(): n for n in S.NAMES}


def _slowlog(r: redis.Redis, shas: dict[str, str]) -> dict[str, list[int]]:
    """Per script (by SHA): [calls, server usec]; other top-level commands under their names."""
    out: dict[str, list[int]] = {}
    for e in r.execute_command("SLOWLOG", "GET", -1):
        args = [a.decode() if isinstance(a, bytes) else str(a) for a in e[3][:2]]
        name = args[0].lower()
        if name == "evalsha" and len(args) > 1:
            name = shas.get(args[1], "evalsha " + args[1][:8])
        s = out.setdefault(name, [0, 0])
        s[0] += 1
        s[1] += int(e[2])
    return out


def run_conductor(r: redis.Redis, url: str, wl: Any, cfg: suite.SuiteConfig, profile: bool) -> dict[str, Any]:
    """One run; ``profile``: SLOWLOG on (every command, those inside scripts too, which costs the server a
    few percent: a profiled run's CPU is not among the medians)."""
    if profile:
        r.config_set("slowlog-max-len", 2_000_000)
        r.config_set("slowlog-log-slower-than", 0)
        r.slowlog_reset()
    cs0 = _cmdstats(r)
    rec = suite.run_conductor(r, url, wl, cfg)
    cs1 = _cmdstats(r)
    scripts: dict[str, list[int]] = {}
    if profile:
        r.config_set("slowlog-log-slower-than", -1)
        scripts = _slowlog(r, _script_names())
        r.slowlog_reset()
    n = len(wl.items)
    cmds = {k: ((c - cs0.get(k, (0, 0))[0]), (u - cs0.get(k, (0, 0))[1])) for k, (c, u) in cs1.items()}
    cmds = {k: v for k, v in cmds.items() if v[0] > 0}
    return {
        "cpu": rec.redis_cpu_us_per_item,
        "complete": rec.complete,
        "items": n,
        "batches": len(rec.batches),
        "claim_calls": rec.claim_calls,
        "scripts": {k: [v[0], v[1]] for k, v in scripts.items()},
        "cmds": {k: list(v) for k, v in cmds.items()},
    }


def run_peer(system: str, r: redis.Redis, wl: Any, cfg: suite.SuiteConfig) -> dict[str, Any]:
    rec = suite.run_peer(system, r, wl, cfg)
    return {"cpu": rec.redis_cpu_us_per_item, "items": len(wl.items)}


def measure(
    points: list[CostPoint],
    reps: int,
    peers: bool,
    *,
    profile: bool = True,
    before: str | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Each point: one profiled run, then ``reps`` runs (with the peers where asked). With ``before``, each
    run of this tree follows one of the before tree's (a child process, its own redis-server), so that
    both columns share the machine's load run by run. Returns {rev, machine, points, before?}."""
    out: dict[str, Any] = {"rev": git_rev() if not _TREE else _rev(_TREE), "points": {}}
    if before:
        out["before"] = {"rev": _rev(before), "points": {}}
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        out["machine"] = machine(r)
        for pt in points:
            wl = generate(pt.spec)
            cfg = suite.SuiteConfig(workers=pt.workers, max_wall_s=1800.0)
            runs: dict[str, list[dict[str, Any]]] = {"conductor": [], "stream": [], "rq": [], "profile": []}
            bruns: dict[str, list[dict[str, Any]]] = {"conductor": [], "profile": []}
            if profile and not before:
                gc.collect()
                runs["profile"].append(run_conductor(r, srv.url, wl, cfg, True))
            for k in range(reps):
                if before:
                    # Both trees alike: each run in a child process on a fresh redis-server (a server kept
                    # across runs, the profiled one and the peers' included, cost this tree's runs more).
                    got = _child(before, pt, profile=profile and k == 0)
                    for key in bruns:
                        bruns[key] += got["points"][pt.name][key]
                    got = _child(str(ROOT), pt, profile=profile and k == 0)
                    for key in ("conductor", "profile"):
                        runs[key] += got["points"][pt.name][key]
                else:
                    gc.collect()
                    runs["conductor"].append(run_conductor(r, srv.url, wl, cfg, False))
                if peers:
                    for s in ("stream", "rq"):
                        gc.collect()
                        runs[s].append(run_peer(s, r, wl, cfg))
                line = "  ".join(f"{s} {v[-1]['cpu']:.1f}" for s, v in runs.items() if v and s != "profile")
                if before:
                    line = f"before {bruns['conductor'][-1]['cpu']:.1f}  " + line
                log(f"  {pt.name}#{k} us/item: {line}  {runs['conductor'][-1]['complete']}")
            out["points"][pt.name] = runs
            if before:
                out["before"]["points"][pt.name] = bruns
    return out


def _child(tree: str, pt: CostPoint, profile: bool) -> dict[str, Any]:
    """One run of point ``pt`` (and a profiled one where asked) on ``tree``'s code, in a child process."""
    env = {**os.environ, "CONDUCTOR_COST_TREE": str(Path(tree).resolve())}
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "run.json"
        cmd = [sys.executable, __file__, "--points", pt.name, "--reps", "1", "--child-json", str(res)]
        subprocess.run(cmd + ([] if profile else ["--no-profile"]), env=env, check=True)
        got: dict[str, Any] = json.loads(res.read_text())
    return got


def _rev(tree: str) -> str:
    p = Path(tree) / ".rev"
    if p.exists():
        return p.read_text().strip()
    try:
        return subprocess.run(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


# ------------------------------------------------------------------------------------ report
def _med(runs: list[dict[str, Any]], key: str = "cpu") -> float:
    return statistics.median(x[key] for x in runs) if runs else float("nan")


def _rng(runs: list[dict[str, Any]]) -> str:
    v = sorted(x["cpu"] for x in runs)
    return f"{v[0]:.1f}-{v[-1]:.1f}" if v else "-"


def _scripts(runs: list[dict[str, Any]]) -> dict[str, tuple[float, float, float]]:
    """Per script, medians over runs: (calls per item, server us per item, us per call)."""
    names = {k for x in runs for k in x["scripts"]}
    out = {}
    for k in names:
        calls = [x["scripts"].get(k, [0, 0])[0] / x["items"] for x in runs]
        us = [x["scripts"].get(k, [0, 0])[1] / x["items"] for x in runs]
        per = [x["scripts"][k][1] / x["scripts"][k][0] for x in runs if x["scripts"].get(k, [0])[0]]
        out[k] = (statistics.median(calls), statistics.median(us), statistics.median(per) if per else 0.0)
    return out


def _cmds(runs: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per command (those scripts run included), medians: (calls per item, us per item)."""
    names = {k for x in runs for k in x["cmds"]}
    return {
        k: (
            statistics.median(x["cmds"].get(k, [0, 0])[0] / x["items"] for x in runs),
            statistics.median(x["cmds"].get(k, [0, 0])[1] / x["items"] for x in runs),
        )
        for k in names
    }


# The benchmark's own commands (a run starts with FLUSHALL, before its CPU is read; SLOWLOG and INFO read it).
_MACHINERY = {"flushall", "config", "slowlog", "info"}


def report(after: dict[str, Any], before: dict[str, Any] | None, reps: int, wall: float) -> str:
    head = ["point", "varies", "landed (fleet section)"]
    if before:
        head.append(f"before ({before['rev']})")
    head += [f"after ({after['rev']}), range"]
    if before:
        head.append("after/before, run by run (median)")
    head += ["plain FIFO stream (limit)", "RQ 2.x (peer)", "after/limit", "goal 30"]
    rows = []
    for name, runs in after["points"].items():
        c = runs["conductor"]
        row = [name, BY_NAME[name].varies, f"{LANDED[name]:.1f}" if name in LANDED else "-"]
        if before:
            b = before["points"].get(name, {}).get("conductor", [])
            row.append(f"{_med(b):.1f} ({_rng(b)})" if b else "-")
        row.append(f"**{_med(c):.1f}** ({_rng(c)})")
        if before:
            b = before["points"].get(name, {}).get("conductor", [])
            ratios = [a["cpu"] / x["cpu"] for a, x in zip(c, b, strict=False)]
            row.append(f"{statistics.median(ratios):.2f}x" if ratios else "-")
        # each run's conductor against the limit run beside it, as the machine's load moves run to run
        lim = [a["cpu"] / x["cpu"] for a, x in zip(c, runs["stream"], strict=False)]
        row += [
            f"{_med(runs['stream']):.1f}",
            f"{_med(runs['rq']):.1f}",
            f"{statistics.median(lim):.1f}x" if lim else "-",
            "met" if _med(c) <= 30 else "missed",
        ]
        rows.append(row)
    parts = [
        "## Redis cost of an item: server CPU per item over a whole job (issue 36)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {after['machine']}  ",
        f"Date: {now_utc()}, commit {after['rev']}; {wall:,.0f} s wall; medians of {reps} runs per point.  ",
        "Redis CPU: INFO cpu (used_cpu_user + used_cpu_sys) over the job's submit and run, per item (submit, claim "
        "and complete together), the real Worker loop on sim engines at time scale 0 (bench/broker/redis_cost.py's "
        "docstring). Limit: a plain Redis stream, XADD pipelined, XREADGROUP COUNT n, XACK and XDEL (no results "
        "written); peer: RQ's enqueue_many and LPOP; both on the same items and workers, same run. Landed: the "
        "fleet section's figures (2026-12-02, commit 9a3a061; ref-2w, f16, f32).",
        "",
        table(head, rows),
        "",
    ]
    for name, runs in after["points"].items():
        c = runs["conductor"]
        sc = _scripts(runs["profile"])
        bsc = _scripts(before["points"][name]["profile"]) if before and name in before["points"] else {}
        sh = ["script or command (SLOWLOG, one profiled run)", "calls/item", "us/item", "us/call"]
        if bsc:
            sh += ["before: calls/item", "us/item", "us/call"]
        srows = []
        for k in sorted(set(sc) | set(bsc), key=lambda k: -sc.get(k, (0, 0, 0))[1]):
            if k in _MACHINERY:
                continue
            a = sc.get(k, (0.0, 0.0, 0.0))
            if a[1] < 0.05 and bsc.get(k, (0, 0, 0))[1] < 0.05:
                continue
            row = [k, f"{a[0]:.4f}", f"{a[1]:.2f}", f"{a[2]:.0f}"]
            if bsc:
                b = bsc.get(k, (0.0, 0.0, 0.0))
                row += [f"{b[0]:.4f}", f"{b[1]:.2f}", f"{b[2]:.0f}"]
            srows.append(row)
        cm = _cmds(c)
        top = sorted(
            (k for k in cm if k not in ("evalsha", "eval") and k.split("|")[0] not in _MACHINERY),
            key=lambda k: -cm[k][1],
        )[:14]
        parts += [
            f"### {name}: where the server time goes (batches {_med(c, 'batches'):,.0f}, claim calls "
            f"{_med(c, 'claim_calls'):,.0f}, items {c[0]['items']:,})",
            "",
            table(sh, srows),
            "",
            "Commands (INFO commandstats deltas, those run inside the scripts included; their time is "
            "inside the scripts' own): "
            + "; ".join(f"{k} {cm[k][0]:.2f}/item {cm[k][1]:.2f} us/item" for k in top)
            + ".",
            "",
        ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick point only (seconds)")
    p.add_argument("--points", default="", metavar="NAME,...", help=f"these points only ({', '.join(BY_NAME)})")
    p.add_argument("--reps", type=int, default=3, help="runs per point (medians reported)")
    p.add_argument("--no-peers", action="store_true", help="skip the FIFO stream and RQ")
    p.add_argument("--before", metavar="DIR", help="also measure another checkout's tree (the before column)")
    p.add_argument("--no-write", action="store_true", help="print only; RESULTS.md untouched")
    p.add_argument("--json", help="write every run's figures as JSON to this file")
    p.add_argument("--child-json", help=argparse.SUPPRESS)
    p.add_argument("--no-profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.points:
        unknown = [n for n in args.points.split(",") if n not in BY_NAME]
        if unknown:
            p.error(f"--points: unknown {unknown}")
        points = [BY_NAME[n] for n in args.points.split(",")]
    else:
        points = [pt for pt in POINTS if pt.quick == args.quick]
    if args.child_json:  # one --before run: measure this tree, hand the figures back
        Path(args.child_json).write_text(
            json.dumps(measure(points, args.reps, False, profile=not args.no_profile, log=lambda _m: None))
        )
        return 0
    t0 = time.monotonic()
    after = measure(points, args.reps, not args.no_peers, before=args.before)
    before = after.pop("before", None)
    bad = [n for n, rs in after["points"].items() if not all(x["complete"].startswith("ok") for x in rs["conductor"])]
    text = report(after, before, args.reps, time.monotonic() - t0)
    if bad:
        text += "\n**INCOMPLETE** at " + ", ".join(bad) + "."
    publish(
        text,
        "redis_cost_quick" if args.quick else "redis_cost",
        write=not args.no_write,
        json_path=args.json,
        data={"after": after, "before": before},
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
