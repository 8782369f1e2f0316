"""Issue 12: a seeded workload sweep, each point against the offline oracle under two cost models.

    .venv/bin/python bench/packing/sweep.py                       # the full sweep; rewrites its RESULTS.md section
    .venv/bin/python bench/packing/sweep.py --quick --no-write    # three points of <= 2,000 items, well under a minute
    .venv/bin/python bench/packing/sweep.py --points ref-2w,shapes-1000 --no-write --json figs.json

Points (``POINTS``): each varies one or two axes from a base of 12,000 items over 30 shapes (Zipf
s=1.1), prefixes of 200..3,000 tokens, suffix lognormal(mu=ln 120, sigma=0.7), 2 workers, a backlog
submitted before the workers start, and the contract 64 items / 65,536 tokens (memory mode). Together
they cover 1k to 1M items, 1 to 1,000 shapes, Zipf 0.6 to 1.5, sigma 0.2 to 1.0, prefixes of 50 to
3,000 tokens, backlog and trickle arrival, and 1, 2, 4, 8 and 16 workers; every point has its own
seed but the issue's two reference points (seed 11). The 1M-item point is part of the default sweep:
it alone takes about 4.5 minutes wall and 1 GB of memory on a 2-core machine (the whole sweep, see
RESULTS.md); ``--quick`` runs only the three quick points.

Systems per point, all on ``conductor.workers.engines.sim.SimEngine`` with the same contract and admission
latch, scheduled in simulated time by ``bench.packing.suite.drive``:

* ``oracle``: ``bench/common/oracle.py`` (its docstring is the rule): length-sorted greedy full batches per
  shape, shapes balanced across workers by estimated work (a deep shape split into length ranges),
  each worker running its own list shape after shape. Planned once per cost model; on trickle points
  the best of several arrival windows per model.
* ``stream``: a plain Redis stream, FIFO token-budget batching (``bench.packing.suite.run_peer``).
* ``conductor``: the real ``conductor.workers.worker.Worker`` loop against the real Lua scripts
  (``bench.packing.suite.run_conductor``); every id must come back exactly once.

Cost models: (1) the sim (finished sequences per simulated second, the fleet's makespan); (2) the
static-batch model of ``bench/common/static_cost.py``, replaying each worker's batches in the order its
engine admitted them (the oracle's too: it runs the same worker loop, whose admission latch may
split a planned batch, as it limits the other systems' claims). Ratios are finished sequences/s
over the oracle's.

Exit status: 0, also when goals are MISSED; 1 when a conductor run lost or duplicated an id.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import static_cost  # noqa: E402
from bench.common.oracle import OBatch, Plan, plan, sim_work  # noqa: E402
from bench.common.report import command_line, git_rev, machine, now_utc, publish, table  # noqa: E402
from bench.common.workload import Workload, WorkloadSpec, generate  # noqa: E402
from bench.packing import suite  # noqa: E402
from conductor.client import connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.workers.worker import WorkerOptions  # noqa: E402

SYSTEMS = ("oracle", "stream", "conductor")
STATIC = static_cost.StaticParams()
WINDOWS = (1, 2, 4, 8, 16, 32, 64, 128)  # arrival windows the oracle tries on trickle points
MIN_WINDOW_ITEMS = 16
POLL_MAX_S = WorkerOptions().poll_max_s  # an idle worker backs off to this while items trickle in


@dataclass(frozen=True)
class Point:
    name: str
    varies: str  # the axes it changes from the base, in words
    spec: WorkloadSpec
    workers: int = 2
    max_batch_size: int = 64
    max_batch_tokens: int = 65_536
    quick: bool = False  # part of --quick
    large: bool = False  # a longer wall-time limit per run

    @property
    def backlog(self) -> bool:
        return self.spec.arrival == "backlog"


def _pt(name: str, varies: str, seed: int, workers: int = 2, tokens: int = 65_536, quick: bool = False,
        large: bool = False, **spec: Any) -> Point:
    base: dict[str, Any] = {"items": 12_000, "shapes": 30, "zipf_s": 1.1, "prefix_min": 200, "prefix_max": 3000,
                            "suffix_sigma": 0.7}
    base.update(spec)
    return Point(name, varies, WorkloadSpec(seed=seed, **base), workers=workers, max_batch_tokens=tokens,
                 quick=quick, large=large)


_DEMO = {"prefix_min": 50, "prefix_max": 250, "suffix_mu": math.log(30), "suffix_sigma": 0.5}
POINTS: list[Point] = [
    _pt("ref-2w", "base (issue reference: 12k items, 30 shapes, seed 11)", 11),
    _pt("ref-8w", "8 workers (issue reference)", 11, workers=8),
    _pt("demo-1k", "README-demo-like: 1k items, 8 shapes, prefixes 50..250, short prompts, 8,192 tokens", 21,
        tokens=8192, items=1000, shapes=8, **_DEMO),
    _pt("items-100k", "100k items", 23, items=100_000),
    _pt("items-1m", "1M items, 300 shapes", 24, items=1_000_000, shapes=300, large=True),
    _pt("shapes-1", "1 shape", 31, shapes=1),
    _pt("shapes-200", "200 shapes", 32, shapes=200),
    _pt("shapes-1000", "1,000 shapes, 20k items", 33, shapes=1000, items=20_000),
    _pt("zipf-0.6", "Zipf s=0.6", 41, zipf_s=0.6),
    _pt("zipf-1.5", "Zipf s=1.5", 42, zipf_s=1.5),
    _pt("sigma-0.2", "narrow lengths (sigma 0.2)", 51, suffix_sigma=0.2),
    _pt("sigma-1.0", "wide lengths (sigma 1.0)", 52, suffix_sigma=1.0),
    _pt("prefix-short", "prefixes 50..300", 61, prefix_min=50, prefix_max=300),
    _pt("prefix-long", "prefixes 2,000..3,000", 62, prefix_min=2000, prefix_max=3000),
    _pt("workers-1", "1 worker", 71, workers=1),
    _pt("workers-4", "4 workers", 72, workers=4),
    _pt("workers-16", "16 workers, 48k items", 73, workers=16, items=48_000),
    _pt("trickle-fast", "trickle at 1,500 items/s", 81, arrival="trickle", rate=1500.0),
    _pt("trickle-slow", "trickle at 100 items/s, 3k items", 82, arrival="trickle", rate=100.0, items=3000),
    # --quick
    _pt("q-demo", "quick: demo-like, 1k items, 8 shapes, 8,192 tokens", 91, tokens=8192, items=1000, shapes=8,
        quick=True, **_DEMO),
    _pt("q-tail", "quick: 2k items, 100 shapes, Zipf 0.6, 4 workers", 92, workers=4, items=2000, shapes=100,
        zipf_s=0.6, quick=True),
    _pt("q-trickle", "quick: trickle at 1,000 items/s, 1.5k items, 10 shapes", 93, items=1500, shapes=10,
        arrival="trickle", rate=1000.0, quick=True),
]
BY_NAME = {p.name: p for p in POINTS}


# ------------------------------------------------------------------------------------ goals
@dataclass
class Goal:
    name: str
    ok: bool
    value: str


def goals(pt: Point, f: dict[str, Any]) -> list[Goal]:
    """The issue's goals for the conductor at one point."""
    c, o = f["conductor"], f["oracle"]
    floor = 0.95 if pt.backlog else 0.85
    out = [Goal(f"sim >= {floor}x oracle", c["ratio_sim"] >= floor, f"{c['ratio_sim']:.2f}x"),
           Goal(f"static >= {floor}x oracle", c["ratio_static"] >= floor, f"{c['ratio_static']:.2f}x")]
    if pt.backlog:
        out += [Goal("fill p50 >= 97 %", c["fill_p50"] >= 0.97, f"{c['fill_p50']:.1%}"),
                Goal("padding <= 1.1x oracle + 0.1 pt", c["padding_waste"] <= 1.1 * o["padding_waste"] + 0.001,
                     f"{c['padding_waste']:.2%} vs {o['padding_waste']:.2%}")]
    out.append(Goal("Redis CPU <= 30 us/item", c["redis_cpu_us_item"] <= 30.0, f"{c['redis_cpu_us_item']:.1f}"))
    return out


# ------------------------------------------------------------------------------------ running
def _plan_batches(p: Plan) -> list[list[static_cost.SBatch]]:
    return [[static_cost.SBatch(b.plen, [(b.sig, [it.id for it in b.items])]) for b in w] for w in p.workers]


def _rec_batches(rec: suite.Record) -> list[list[static_cost.SBatch]]:
    return [static_cost.batches_from_log(e.log) for e in rec.engines]


def _common(rec: suite.Record, cfg: suite.SuiteConfig, st: static_cost.StaticResult) -> dict[str, Any]:
    f = suite.figures(rec, cfg)
    n = max(1, rec.items)
    f.update({
        "static": st.as_dict(), "static_seq_s": st.seq_s,
        "claims_batch_per_item": len(rec.batches) / n, "claims_all_per_item": rec.claim_calls / n,
        "items_per_batch": f["finished"] / max(1, len(rec.batches)), "complete": rec.complete,
        "notes": rec.notes,
    })
    return f


def run_oracle(wl: Workload, pt: Point, cfg: suite.SuiteConfig, items: static_cost.Items) -> dict[str, Any]:
    """The oracle under both models. Two plans, one made with each model's work estimate, each run
    through the same worker loop as the other systems (so the latch splits its batches as it
    splits theirs). Sim figure: the sim plan's run; static figure: the better of the two runs'
    admissions replayed by the static model. On trickle points, the best arrival window count
    per model as well."""
    ws = [1] if pt.backlog else [w for w in WINDOWS if len(wl.items) // w >= MIN_WINDOW_ITEMS] or [1]
    prefixes = suite.oracle_prefixes(wl)
    arrival = None if pt.backlog else wl.arrival_s

    def static_work(b: OBatch) -> float:  # every oracle batch has a length of its own: one graph each
        return static_cost.estimate(STATIC, len(b.items), b.plen, b.prefix, b.out) + STATIC.graph_build

    best_sim: tuple[float, int, suite.Record] | None = None
    best_static: tuple[float, str, static_cost.StaticResult, static_cost.StaticResult] | None = None
    for w in ws:
        for model, work in (("sim", sim_work(high_water=cfg.high_water)), ("static", static_work)):
            p = plan(wl.items, prefixes, pt.workers, pt.max_batch_size, pt.max_batch_tokens, work, arrival, w)
            rec = suite.run_oracle(wl, cfg, p, arrival=not pt.backlog)
            if model == "sim":
                seq = suite.figures(rec, cfg)["seq_s"]
                if best_sim is None or seq > best_sim[0]:
                    best_sim = (seq, w, rec)
            st = static_cost.replay(_rec_batches(rec), items, STATIC)
            if best_static is None or st.seq_s > best_static[0]:
                best_static = (st.seq_s, f"{model} plan, {w} window(s)", st,
                               static_cost.replay(_plan_batches(p), items, STATIC))
            del rec
        gc.collect()
    assert best_sim is not None and best_static is not None
    f = _common(best_sim[2], cfg, best_static[2])
    f["windows_sim"], f["static_from"] = best_sim[1], best_static[1]
    f["static_plan_unsplit"] = best_static[3].as_dict()  # that plan replayed without the latch's splits
    f["complete"] = "n/a (offline)"
    return f


def run_point(pt: Point, r: Any, url: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    t0 = time.monotonic()
    wl = generate(pt.spec)
    cfg = suite.SuiteConfig(workers=pt.workers, max_batch_size=pt.max_batch_size,
                            max_batch_tokens=pt.max_batch_tokens, max_wall_s=3600.0 if pt.large else 900.0,
                            idle_max_s=POLL_MAX_S)
    items = static_cost.Items(wl.items, wl.arrival_s, suite.oracle_prefixes(wl))
    figs: dict[str, Any] = {}
    for s in SYSTEMS:
        gc.collect()
        if s == "oracle":
            figs[s] = run_oracle(wl, pt, cfg, items)
        else:
            rec = suite.run_conductor(r, url, wl, cfg) if s == "conductor" else suite.run_peer(s, r, wl, cfg)
            figs[s] = _common(rec, cfg, static_cost.replay(_rec_batches(rec), items, STATIC))
            del rec
    o = figs["oracle"]
    for s in SYSTEMS:
        f = figs[s]
        f["ratio_sim"] = f["seq_s"] / o["seq_s"]
        f["ratio_static"] = f["static_seq_s"] / o["static_seq_s"]
        f["padding_ratio"] = f["padding_waste"] / o["padding_waste"] if o["padding_waste"] else float("nan")
    out = {"point": pt.name, "varies": pt.varies, "workers": pt.workers, "spec": dataclasses.asdict(pt.spec),
           "contract": [pt.max_batch_size, pt.max_batch_tokens], "systems": figs,
           "shapes_with_items": len({it.sig for it in wl.items})}
    out["goals"] = [dataclasses.asdict(g) for g in goals(pt, figs)]
    out["wall_s"] = time.monotonic() - t0
    c = figs["conductor"]
    log(f"  {pt.name:13s} conductor/oracle sim {c['ratio_sim']:.2f}x static {c['ratio_static']:.2f}x  "
        f"stream {figs['stream']['ratio_sim']:.2f}x/{figs['stream']['ratio_static']:.2f}x  fill p50 "
        f"{c['fill_p50']:.1%}  pad {c['padding_waste']:.2%} (oracle {o['padding_waste']:.2%})  "
        f"cpu {c['redis_cpu_us_item']:.1f} us  wall {out['wall_s']:.1f}s  {c['complete']}")
    return out


def run_sweep(points: list[Point], log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], str]:
    results = []
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        mach = machine(r)
        log(f"redis-server on port {srv.port}; {mach}")
        for pt in points:
            results.append(run_point(pt, r, srv.url, log))
            gc.collect()
    return results, mach


# ------------------------------------------------------------------------------------ report
def _x(v: float) -> str:
    return "n/a" if v != v else f"{v:.2f}x"


def _g(res: dict[str, Any]) -> str:
    missed = [g["name"] for g in res["goals"] if not g["ok"]]
    return "met" if not missed else "**MISSED**: " + "; ".join(missed)


HEADER = ["point", "varies", "items", "shapes", "W", "arrival", "cond/oracle sim", "cond/oracle static",
          "stream/oracle sim", "stream/oracle static", "fill p50 / p90", "padding (oracle)", "padding ratio",
          "Redis CPU us/item", "claims/item (batch / all)", "batches", "items/batch", "switches/worker",
          "wall s", "goals"]


def rows(results: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for res in results:
        sp, f = res["spec"], res["systems"]
        c, o, s = f["conductor"], f["oracle"], f["stream"]
        arr = "backlog" if sp["arrival"] == "backlog" else f"trickle {sp['rate']:,.0f}/s"
        out.append([
            res["point"], res["varies"], f"{sp['items']:,}", f"{sp['shapes']:,}", str(res["workers"]), arr,
            _x(c["ratio_sim"]), _x(c["ratio_static"]), _x(s["ratio_sim"]), _x(s["ratio_static"]),
            f"{c['fill_p50']:.1%} / {c['fill_p90']:.1%}", f"{c['padding_waste']:.2%} ({o['padding_waste']:.2%})",
            _x(c["padding_ratio"]), f"{c['redis_cpu_us_item']:.1f}",
            f"{c['claims_batch_per_item']:.3f} / {c['claims_all_per_item']:.3f}",
            f"{c['batches']:,} ({o['batches']:,})", f"{c['items_per_batch']:.1f} ({o['items_per_batch']:.1f})",
            f"{c['switches_per_worker']:,.1f} ({o['switches_per_worker']:,.1f})", f"{res['wall_s']:.1f}", _g(res)])
    return out


def report(args: argparse.Namespace, mach: str, results: list[dict[str, Any]], plot: str | None,
           total_wall: float) -> str:
    incomplete = [r_["point"] for r_ in results if not r_["systems"]["conductor"]["complete"].startswith("ok")]
    missed = [r_ for r_ in results if any(not g["ok"] for g in r_["goals"])]
    unsplit = [r_["systems"]["oracle"]["static_plan_unsplit"]["seq_s"] / r_["systems"]["oracle"]["static_seq_s"]
               for r_ in results]
    graph_share = [st["graph_s"] / max(1e-9, st["prefill_s"] + st["decode_s"] + st["graph_s"])
                   for st in (r_["systems"]["oracle"]["static"] for r_ in results)]
    lines = [
        f"## Workload sweep: conductor vs stream vs oracle under two cost models (issue 12"
        f"{', quick' if args.quick else ''})" + (f": {args.note}" if args.note else ""),
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {mach}  ",
        f"Date: {now_utc()}, commit {args.rev or git_rev()}; the whole sweep took {total_wall:,.0f} s wall.  ",
        "Base point: 12,000 items, 30 shapes (Zipf s=1.1), prefixes 200..3,000 tokens, suffix lognormal(mu=ln "
        "120, sigma=0.7), output limits [16, 32, 64, 128] per shape, 2 workers, backlog, contract 64 items / "
        "65,536 tokens (memory mode), max input 8,192, latch 1024/768; each point varies what its row says "
        "(bench/packing/sweep.py `POINTS`, each with its own seed but the issue's reference points, seed 11).  ",
        "Systems: `oracle` (bench/common/oracle.py: every item known in advance; each shape sorted by length and cut "
        "greedily into full batches; shapes balanced across workers longest-processing-time first by estimated "
        "work, a deep shape split into contiguous length ranges over several workers; each worker runs its own "
        "list shape after shape; planned per cost model; on trickle points the best of 1..128 arrival windows "
        "per model, a batch waiting for its last item), `stream` (a plain Redis stream, FIFO token-budget "
        "batches that mix shapes), `conductor` (the real Worker loop on the real Lua scripts, default config).  ",
        "Cost models: **sim** = finished sequences per SIMULATED second of `SimEngine` (default SimParams: "
        "prefill 2 us/token, decode step 6 ms + 20 us/sequence, continuous batching under the latch, graph 50 "
        "ms per (padded length, shape, epoch), 1-shape prefix cache; the oracle prewarms its next batch's "
        f"graph); **static** = bench/common/static_cost.py replaying each worker's batches in the order its engine "
        f"admitted them (the oracle's too, latch splits included): {STATIC.describe()}; prefix cached for every "
        "item when the worker's previous batch had the shape, else for all but the first; a batch is ready at "
        "its last item's arrival. The two models differ about 15x in speed: under the static model the fast "
        "trickle is a backlog after its first seconds.  ",
        "Columns: ratios are finished sequences/s over the oracle's; fill = max(padded tokens / budget, items / "
        "items asked for) (suite.batch_fill); padding = (padded - actual) / padded tokens, from the sim's "
        "counters; claims/item = claim calls that returned a batch / items, and all claim calls / items; "
        "batches, items/batch and switches/worker (the sim's prefix-cache shape switches) are the conductor's "
        "with the oracle's in brackets; W = workers; wall = the whole point (three systems); Redis CPU = the "
        "server's used_cpu_user+sys over the conductor's submit and run, per item (it varies by tens of percent "
        "from run to run on a shared 2-core machine; on trickle points it includes the claims of idle workers, "
        "which back off to 50 ms as Worker.run does).  ",
        "Goals (conductor): backlog points >= 0.95x the oracle under both models, fill p50 >= 97 %, padding <= "
        "1.1x the oracle's + 0.1 point, Redis CPU (submit + claim + complete, the server's user+sys) <= 30 us "
        "per item; trickle points >= 0.85x under both models and the Redis CPU goal.",
        "",
        table(HEADER, rows(results)),
        "",
        f"Static oracle, two caveats: its batches are the ones its run admitted, so the latch's partial asks split "
        f"some of them as they limit the other systems' claims (its plan replayed unsplit, JSON "
        f"`static_plan_unsplit`, is {min(unsplit):.2f}x to {max(unsplit):.2f}x faster under the static model); and "
        f"every batch it cuts has a padded length of its own, so graph builds are {min(graph_share):.0%} to "
        f"{max(graph_share):.0%} of its static time, which a system reusing lengths can save.",
        "",
        "Conductor results: " + ("ok: every id exactly once at every point." if not incomplete
                                 else "**INCOMPLETE** at " + ", ".join(incomplete) + "."),
        f"Goals: {len(results) - len(missed)} of {len(results)} points meet every goal"
        + ("." if not missed else "; MISSED at " + ", ".join(r_["point"] for r_ in missed) + "."),
    ]
    if plot:
        here = Path(__file__).resolve().parents[1]
        lines += ["", f"Plot: [{Path(plot).name}]({Path(plot).relative_to(here)})"]
    return "\n".join(lines)


def make_plot(results: list[dict[str, Any]], out: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    names = [r_["point"] for r_ in results]
    xs = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.5 * len(names) + 4), 4.8))
    for sysname, model, marker, style, color in (("conductor", "sim", "o", "-", "C0"),
                                                 ("conductor", "static", "s", "-", "C1"),
                                                 ("stream", "sim", "o", ":", "C0"),
                                                 ("stream", "static", "s", ":", "C1")):
        ys = [r_["systems"][sysname][f"ratio_{model}"] for r_ in results]
        ax.plot(xs, ys, linestyle=style, marker=marker, color=color, label=f"{sysname}, {model} model",
                fillstyle="full" if sysname == "conductor" else "none")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.95, color="green", linewidth=0.8, linestyle="--", label="goal 0.95x (backlog)")
    ax.axhline(0.85, color="orange", linewidth=0.8, linestyle="--", label="goal 0.85x (trickle)")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("finished sequences/s / oracle's (log)")
    ax.set_title("Ratio to the offline oracle across the sweep, both cost models")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return str(out)


def select(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[Point]:
    if args.points:
        names = [n for n in args.points.split(",") if n]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            p.error(f"--points: unknown {unknown} (known: {', '.join(BY_NAME)})")
        return [BY_NAME[n] for n in names]
    return [pt for pt in POINTS if pt.quick == args.quick]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick points only (<= 2,000 items, well under a minute)")
    p.add_argument("--points", default="", metavar="NAME,...", help="run these points only (any of POINTS)")
    p.add_argument("--no-write", action="store_true", help="print only; RESULTS.md and the plot untouched")
    p.add_argument("--json", help="also write every point's figures as JSON to this file")
    p.add_argument("--section", help="RESULTS.md section (default: sweep, or sweep_quick with --quick); "
                                     "the plot goes to bench/plots/<section>/")
    p.add_argument("--note", default="", help="appended to the section's title (e.g. what the run is a baseline of)")
    p.add_argument("--rev", default="", help="the commit the measured code is at (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    points = select(args, p)
    t0 = time.monotonic()
    results, mach = run_sweep(points)
    total = time.monotonic() - t0
    section = args.section or ("sweep_quick" if args.quick else "sweep")
    plot = None if args.no_write else make_plot(
        results, Path(__file__).resolve().parents[1] / "plots" / section / "ratio_to_oracle.png")
    text = report(args, mach, results, plot, total)
    publish(text, section, write=not args.no_write, json_path=args.json, data=results)
    return 0 if all(r_["systems"]["conductor"]["complete"].startswith("ok") for r_ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
