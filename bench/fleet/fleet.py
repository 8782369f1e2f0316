"""Issue 24: a fleet that finishes together. Fleet points against the offline oracle under both cost models.

    .venv/bin/python bench/fleet/fleet.py                      # every point; rewrites its RESULTS.md section
    .venv/bin/python bench/fleet/fleet.py --quick --no-write   # two small points, seconds (the test suite runs it)
    .venv/bin/python bench/fleet/fleet.py --points f8,join-8 --seeds 3 --no-write

Each point is run on the same machinery as bench/packing/sweep.py (the real ``Worker`` loop on the real Lua
scripts, in simulated time; ``oracle`` and its two cost models from there), with a fleet of 4 to 32
workers and what happens to a fleet: the fleet up first and the backlog after (``fleet-first``, as
under systemd), the backlog first and the workers registering at their first turn
(``backlog-first``), a trickle while the fleet runs, workers joining when a quarter of the items
finished (autoscaling) and leaving (two drained at 40 %, as SIGTERM does, one killed at 60 %, its
batches reclaimed), a wide workload (300 shapes) and a deep one (one shape, 20k items); and the
shared-prefix workload after llm-d's: 64 tenants, each a system prompt of 1,000 to 3,000 tokens, on
16 workers, where the prefix tokens the sim recomputed are set against the oracle's and against a
random placement (each planned batch to a worker drawn at random).

The oracle is planned for the whole fleet from the start: on the join and leave points it had
more workers than the conductor for part of the run, so its ratio there is a lower bound.

Figures per point (conductor, oracle in brackets): finished sequences/s over the oracle's under
the sim and the static model; busy max/mean (each worker's simulated engine time); shape switches
per worker; returns (a worker taking a batch of a shape instance it had left, which therefore still
had items); padding; prefix tokens recomputed; Redis CPU per item. ``--seeds K`` runs each point on
K seeds (the point's and K-1 others) and reports medians: one run of a point moves by several
percent with the order in which workers happen to meet the shapes.

Exit status: 0, also when goals are missed; 1 when a conductor run lost or duplicated an id.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import static_cost  # noqa: E402
from bench.common.oracle import Item as OItem  # noqa: E402
from bench.common.oracle import Plan, cut_shape  # noqa: E402
from bench.common.report import command_line, git_rev, machine, now_utc, publish, table  # noqa: E402
from bench.common.workload import WorkloadSpec, generate  # noqa: E402
from bench.packing import suite, sweep  # noqa: E402
from conductor.client import connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402


@dataclass(frozen=True)
class FleetPoint:
    name: str
    varies: str
    spec: WorkloadSpec
    workers: int
    events: tuple[tuple[float, int, str], ...] = ()
    late_fleet: bool = False
    random_placement: bool = False  # also price a random placement of the oracle's batches (prefix point)
    quick: bool = False


def _spec(seed: int, items: int, shapes: int, **kw: Any) -> WorkloadSpec:
    return WorkloadSpec(seed=seed, items=items, shapes=shapes, **kw)


_JOIN = tuple((0.25, i, "join") for i in range(4, 8))
_LEAVE = ((0.4, 6, "drain"), (0.4, 7, "drain"), (0.6, 5, "kill"))
POINTS: list[FleetPoint] = [
    FleetPoint("f4", "4 workers, 12k items, 30 shapes", _spec(101, 12_000, 30), 4),
    FleetPoint("f8", "8 workers, 16k items, 40 shapes (issue 24's first case)", _spec(102, 16_000, 40), 8),
    FleetPoint("f16", "16 workers, 24k items, 120 shapes (issue 24's second case)", _spec(103, 24_000, 120), 16),
    FleetPoint("f32", "32 workers, 48k items, 120 shapes", _spec(104, 48_000, 120), 32),
    FleetPoint("backlog-first-8", "f8's items, the backlog submitted before the workers register",
               _spec(102, 16_000, 40), 8, late_fleet=True),
    FleetPoint("trickle-8", "f8's items trickling at 4,000/s while the fleet runs",
               _spec(105, 16_000, 40, arrival="trickle", rate=4000.0), 8),
    FleetPoint("join-8", "4 workers, 4 more join at 25 % finished", _spec(106, 16_000, 40), 8, events=_JOIN),
    FleetPoint("leave-8", "8 workers, 2 drained (SIGTERM) at 40 %, 1 killed (SIGKILL) at 60 %",
               _spec(107, 16_000, 40), 8, events=_LEAVE),
    FleetPoint("wide-8", "300 shapes, 16k items", _spec(108, 16_000, 300), 8),
    FleetPoint("deep-8", "one shape, 20k items", _spec(109, 20_000, 1), 8),
    FleetPoint("prefix-16", "64 tenants, system prompts of 1,000-3,000 tokens, 24k items, Zipf 0.8",
               _spec(110, 24_000, 64, prefix_min=1000, prefix_max=3000, zipf_s=0.8), 16, random_placement=True),
    FleetPoint("q-fleet", "quick: 4 workers, 2k items, 12 shapes, one joining", _spec(191, 2000, 12), 4,
               events=((0.2, 3, "join"),), quick=True),
    FleetPoint("q-leave", "quick: 4 workers, 2k items, one drained, one killed", _spec(192, 2000, 12), 4,
               events=((0.3, 2, "drain"), (0.5, 3, "kill")), quick=True),
]
BY_NAME = {p.name: p for p in POINTS}


# ------------------------------------------------------------------------------------ figures
def returns(engine: suite.RecordingSim) -> int:
    """Batches a worker took of a shape instance it had left before (so the instance still had items)."""
    left: set[str] = set()
    out = 0
    prev = None
    for inst in engine.instances:
        if inst != prev:
            if inst in left:
                out += 1
            if prev is not None:
                left.add(prev)
            prev = inst
    return out


def fleet_figures(rec: suite.Record) -> dict[str, float]:
    busy = [e.counters.sim_seconds for e in rec.engines if e.counters.sim_seconds > 0]
    return {"busy_max_mean": max(busy) / statistics.mean(busy) if busy else float("nan"),
            "returns": sum(returns(e) for e in rec.engines),
            "prefix_miss": sum(e.counters.prefix_miss_tokens for e in rec.engines)}


def random_plan(wl: Any, workers: int, size: int, budget: int, seed: int) -> Plan:
    """The oracle's batches, each placed on a worker drawn at random (llm-d's random placement)."""
    prefixes = suite.oracle_prefixes(wl)
    by_shape: dict[str, list[OItem]] = {}
    for p in wl.items:
        by_shape.setdefault(p.sig, []).append(OItem(p.id, p.sig, p.input_tokens, p.max_tokens))
    batches = [b for sig, its in by_shape.items() for b in cut_shape(its, prefixes[sig], size, budget)]
    rng = random.Random(seed)
    rng.shuffle(batches)
    lists: list[list[Any]] = [[] for _ in range(workers)]
    for b in batches:
        lists[rng.randrange(workers)].append(b)
    return Plan(lists)


def run_point(pt: FleetPoint, seed_k: int, r: Any, url: str, log: Any = print) -> dict[str, Any]:
    t0 = time.monotonic()
    spec = pt.spec if seed_k == 0 else dataclasses.replace(pt.spec, seed=pt.spec.seed + 1000 * seed_k)
    wl = generate(spec)
    base = sweep.Point(pt.name, pt.varies, spec, workers=pt.workers)
    cfg = suite.SuiteConfig(workers=pt.workers, max_batch_size=base.max_batch_size,
                            max_batch_tokens=base.max_batch_tokens, max_wall_s=1800.0, idle_max_s=sweep.POLL_MAX_S,
                            events=pt.events, late_fleet=pt.late_fleet)
    items = static_cost.Items(wl.items, wl.arrival_s, suite.oracle_prefixes(wl))
    o = sweep.run_oracle(wl, base, cfg, items)
    # the oracle's prefix misses: its sim plan's run (sweep.run_oracle keeps figures, not the record)
    orec = suite.run_oracle(wl, cfg)
    o.update(fleet_figures(orec))
    del orec
    gc.collect()
    rec = suite.run_conductor(r, url, wl, cfg)
    c = sweep._common(rec, cfg, static_cost.replay(sweep._rec_batches(rec), items, sweep.STATIC))
    c.update(fleet_figures(rec))
    del rec
    out: dict[str, Any] = {"point": pt.name, "seed": spec.seed, "varies": pt.varies, "workers": pt.workers,
                           "items": spec.items, "shapes": spec.shapes, "oracle": o, "conductor": c,
                           "ratio_sim": c["seq_s"] / o["seq_s"], "ratio_static": c["static_seq_s"] / o["static_seq_s"]}
    if pt.random_placement:
        rrec = suite.run_oracle(wl, cfg, random_plan(wl, pt.workers, base.max_batch_size, base.max_batch_tokens,
                                                     spec.seed))
        out["random_prefix_miss"] = fleet_figures(rrec)["prefix_miss"]
        del rrec
    out["wall_s"] = time.monotonic() - t0
    log(f"  {pt.name}#{seed_k} sim {out['ratio_sim']:.3f} static {out['ratio_static']:.3f} busy max/mean "
        f"{c['busy_max_mean']:.3f} ({o['busy_max_mean']:.3f}) switches {c['switches_per_worker']:.1f} "
        f"({o['switches_per_worker']:.1f}) returns {c['returns']} cpu {c['redis_cpu_us_item']:.1f} us "
        f"{c['complete']} {out['wall_s']:.0f}s")
    return out


# ------------------------------------------------------------------------------------ report
def _med(runs: list[dict[str, Any]], f: Any) -> float:
    return statistics.median(f(x) for x in runs)


def summarize(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    c = lambda k: _med(runs, lambda x: x["conductor"][k])  # noqa: E731
    o = lambda k: _med(runs, lambda x: x["oracle"][k])  # noqa: E731
    s = {"point": name, "varies": runs[0]["varies"], "workers": runs[0]["workers"], "items": runs[0]["items"],
         "shapes": runs[0]["shapes"], "runs": len(runs),
         "sim": _med(runs, lambda x: x["ratio_sim"]), "static": _med(runs, lambda x: x["ratio_static"]),
         "sim_min": min(x["ratio_sim"] for x in runs), "static_min": min(x["ratio_static"] for x in runs),
         "busy": c("busy_max_mean"), "obusy": o("busy_max_mean"),
         "switches": c("switches_per_worker"), "oswitches": o("switches_per_worker"),
         "returns": max(x["conductor"]["returns"] for x in runs),
         "pad": c("padding_waste"), "opad": o("padding_waste"),
         "miss": c("prefix_miss"), "omiss": o("prefix_miss"), "cpu": c("redis_cpu_us_item"),
         "claims": c("claims_all_per_item"),
         "complete": all(x["conductor"]["complete"].startswith("ok") for x in runs)}
    if "random_prefix_miss" in runs[0]:
        s["rmiss"] = _med(runs, lambda x: x["random_prefix_miss"])
    return s


def goals(s: dict[str, Any], cpu_2w: float | None) -> list[str]:
    """The issue's goals a point misses (medians over its seeds)."""
    miss = []
    if s["sim"] < 0.95:
        miss.append(f"sim {s['sim']:.2f}x < 0.95x")
    if s["static"] < 0.95:
        miss.append(f"static {s['static']:.2f}x < 0.95x")
    if s["busy"] > 1.10:
        miss.append(f"busy max/mean {s['busy']:.2f} > 1.10")
    if s["switches"] > 1.2 * s["oswitches"] + 1e-9:
        miss.append(f"switches {s['switches']:.1f} > 1.2 x {s['oswitches']:.1f}")
    if s["returns"]:
        miss.append(f"{s['returns']} returns")
    if s["pad"] > 1.1 * s["opad"] + 0.001:
        miss.append(f"padding {s['pad']:.2%} > 1.1 x {s['opad']:.2%} + 0.1 pt")
    if s["omiss"] and s["miss"] > 1.1 * s["omiss"]:
        miss.append(f"prefix recomputed {s['miss'] / s['omiss']:.2f}x the oracle's")
    if "rmiss" in s and s["miss"] * 2 > s["rmiss"]:
        miss.append("prefix recomputed not 2x below random placement")
    if cpu_2w is not None and s["cpu"] > cpu_2w * 1.1:
        miss.append(f"Redis CPU {s['cpu']:.0f} us/item > {cpu_2w:.0f} at 2 workers")
    return miss


HEADER = ["point", "varies", "W", "items", "shapes", "runs", "cond/oracle sim (min)", "cond/oracle static (min)",
          "busy max/mean (oracle)", "switches/worker (oracle)", "returns", "padding (oracle)",
          "prefix tokens recomputed (oracle)", "Redis CPU us/item (claims/item)", "goals missed"]


def rows(summaries: list[dict[str, Any]], cpu_2w: float | None) -> list[list[str]]:
    out = []
    for s in summaries:
        miss = s["miss"] / s["omiss"] if s["omiss"] else float("nan")
        pref = f"{s['miss']:,.0f} ({s['omiss']:,.0f}; {miss:.2f}x)"
        if "rmiss" in s:
            pref += f"; random placement {s['rmiss']:,.0f}"
        missed = goals(s, cpu_2w)
        out.append([s["point"], s["varies"], str(s["workers"]), f"{s['items']:,}", f"{s['shapes']:,}",
                    str(s["runs"]), f"{s['sim']:.2f}x ({s['sim_min']:.2f})",
                    f"{s['static']:.2f}x ({s['static_min']:.2f})", f"{s['busy']:.2f} ({s['obusy']:.2f})",
                    f"{s['switches']:.1f} ({s['oswitches']:.1f})", str(s["returns"]),
                    f"{s['pad']:.2%} ({s['opad']:.2%})", pref, f"{s['cpu']:.1f} ({s['claims']:.3f})",
                    "none" if not missed else "; ".join(missed)])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick points only (seconds)")
    p.add_argument("--points", default="", metavar="NAME,...", help="run these points only")
    p.add_argument("--seeds", type=int, default=1, help="runs per point, each on its own seed (medians reported)")
    p.add_argument("--no-write", action="store_true", help="print only; RESULTS.md untouched")
    p.add_argument("--json", help="also write every run's figures as JSON to this file")
    p.add_argument("--section", help="RESULTS.md section (default: fleet, or fleet_quick with --quick)")
    args = p.parse_args(argv)
    if args.points:
        unknown = [n for n in args.points.split(",") if n not in BY_NAME]
        if unknown:
            p.error(f"--points: unknown {unknown} (known: {', '.join(BY_NAME)})")
        points = [BY_NAME[n] for n in args.points.split(",")]
    else:
        points = [pt for pt in POINTS if pt.quick == args.quick]
    t0 = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {}
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        mach = machine(r)
        print(f"redis-server on port {srv.port}; {mach}", flush=True)
        # the Redis CPU goal's yardstick: the same machinery's 2-worker reference point, this run
        ref = sweep.run_point(sweep.BY_NAME["ref-2w"], r, srv.url, log=lambda _m: None) if not args.quick else None
        for pt in points:
            runs[pt.name] = [run_point(pt, k, r, srv.url) for k in range(max(1, args.seeds))]
            gc.collect()
    cpu_2w = ref["systems"]["conductor"]["redis_cpu_us_item"] if ref else None
    summaries = [summarize(n, rs) for n, rs in runs.items()]
    bad = [s["point"] for s in summaries if not s["complete"]]
    met = [s for s in summaries if not goals(s, cpu_2w)]
    text = "\n".join([
        f"## Fleet: conductor vs oracle, 4 to 32 workers (issue 24{', quick' if args.quick else ''})",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {mach}  ",
        f"Date: {now_utc()}, commit {git_rev()}; {time.monotonic() - t0:,.0f} s wall.  ",
        "Each point: the real Worker loop on the real Lua scripts in simulated time against the oracle "
        "(bench/packing/sweep.py's two cost models and oracle; bench/fleet/fleet.py's docstring says what each "
        "point does); "
        "figures are medians over the runs (seeds), the worst ratio in brackets; the oracle's in brackets "
        "elsewhere. Busy = each worker's simulated engine seconds. Returns: batches a worker took of a shape "
        "instance it had left. Prefix tokens recomputed: the sim's prefix-cache misses."
        + (f" Redis CPU goal: at most 1.1x the 2-worker reference point's {cpu_2w:.1f} us/item in this run "
           f"(bench/packing/sweep.py ref-2w)." if cpu_2w is not None else ""),
        "",
        table(HEADER, rows(summaries, cpu_2w)),
        "",
        "Conductor results: " + ("ok: every id exactly once in every run." if not bad
                                 else "**INCOMPLETE** at " + ", ".join(bad) + "."),
        f"Goals: {len(met)} of {len(summaries)} points meet every goal.",
    ])
    publish(text, args.section or ("fleet_quick" if args.quick else "fleet"), write=not args.no_write,
            json_path=args.json, data=runs)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
