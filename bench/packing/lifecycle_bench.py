"""Issue 3's benchmark: the shape lifecycle against a FIFO stream, backlog and trickle, 2 workers.

    .venv/bin/python bench/packing/lifecycle_bench.py            # rewrites its RESULTS.md section
    .venv/bin/python bench/packing/lifecycle_bench.py --quick    # small sizes, prints only

For each arrival mode it runs, on one private redis-server and the same seeded workload (50
shapes, Zipf popularity, lognormal lengths: bench/common/workload.py), the conductor and the plain
Redis stream with FIFO token-budget batching (bench/packing/suite.py), each with 2 workers on the sim
engine, and prints: broker shape activations and engine shape switches per worker (goal: each
shape activated once, no switch in steady state), the sim's prefix-cache hit rate in tokens
(goal >= 99.9 %), batches per shape, items left at the end (goal 0), time in cleanup, and the
fill of the first ten batches (goal >= 99 % under trickle arrival). Throughput figures are in
SIMULATED GPU seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.report import command_line, git_rev, machine, median, now_utc, table, write_section  # noqa: E402
from bench.common.workload import WorkloadSpec, generate  # noqa: E402
from bench.packing.suite import Record, SuiteConfig, batch_fill, figures, run_conductor, run_peer  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402


def lifecycle_figures(rec: Record, cfg: SuiteConfig, state: dict[str, str], shapes: int) -> dict[str, float]:
    f = figures(rec, cfg)
    per_shape = Counter(s for *_x, sigs in rec.batches for s in sigs)
    first = [batch_fill(n, plen, asked, cfg) for n, plen, _a, asked, _s in rec.batches[:10]]
    left = rec.items - f["finished"]
    return {
        "activations": float(state.get("activations", "nan")) if state else float("nan"),
        "activations_per_shape": float(state.get("activations", 0)) / shapes if state else float("nan"),
        "switches_per_worker": f["switches_per_worker"],
        "prefix_hit": f["prefix_hit"],
        "batches_per_shape_p50": median(list(per_shape.values())),
        "batches_per_shape_min": min(per_shape.values()) if per_shape else float("nan"),
        "items_left": float(left),
        "cleanup_s": float(state.get("cleanup_ms", 0)) / 1000 if state else float("nan"),
        "cleanup_entries": float(state.get("cleanup_entries", 0)) if state else float("nan"),
        "first10_fill_min": min(first) if first else float("nan"),
        "first10_fill_mean": sum(first) / len(first) if first else float("nan"),
        "seq_s": f["seq_s"],
        "padding_waste": f["padding_waste"],
    }


ROWS = [
    ("activations_per_shape", "broker activations per shape (goal 1)", "{:.2f}"),
    ("switches_per_worker", "engine shape switches per worker", "{:,.1f}"),
    ("prefix_hit", "sim prefix-cache hit, tokens (goal >= 99.9 %)", "{:.3%}"),
    ("batches_per_shape_p50", "batches per shape, median", "{:,.0f}"),
    ("batches_per_shape_min", "batches per shape, smallest shape", "{:,.0f}"),
    ("items_left", "items left at the end (goal 0)", "{:,.0f}"),
    ("cleanup_s", "time in cleanup mode, wall s", "{:.2f}"),
    ("cleanup_entries", "cleanup entries", "{:,.0f}"),
    ("first10_fill_min", "fill of the first ten batches, min (goal >= 99 % under trickle)", "{:.1%}"),
    ("first10_fill_mean", "fill of the first ten batches, mean", "{:.1%}"),
    ("seq_s", "finished sequences/s (SIMULATED GPU time)", "{:,.1f}"),
    ("padding_waste", "padding waste", "{:.3%}"),
]


def _fmt(fmt: str, v: float) -> str:
    return "n/a" if v != v else fmt.format(v)


def run(quick: bool) -> str:
    items = 5_000 if quick else 40_000
    cfg = SuiteConfig(workers=2)
    out = []
    with EmbeddedRedis() as srv:
        import redis
        r = redis.Redis(port=srv.port)
        mach = machine(r)
        for arrival in ("backlog", "trickle"):
            spec = WorkloadSpec(items=items, shapes=50, arrival=arrival, rate=1500.0, seed=11)
            wl = generate(spec)
            recs, figs = {}, {}
            for system in ("stream", "conductor"):
                if system == "conductor":
                    rec = run_conductor(r, srv.url, wl, cfg, job=f"life-{arrival}")
                    raw = {**r.hgetall(K.ModelKeys(spec.model).state), **r.hgetall(K.ModelKeys(spec.model).intake)}
                    state = {k.decode(): v.decode() for k, v in raw.items()}
                else:
                    rec, state = run_peer(system, r, wl, cfg), {}
                recs[system] = rec
                figs[system] = lifecycle_figures(rec, cfg, state, spec.shapes)
                print(f"{arrival} {system}: {figs[system]}", flush=True)
            rows = [[label, _fmt(fmt, figs["stream"][k]), _fmt(fmt, figs["conductor"][k])] for k, label, fmt in ROWS]
            out.append(f"### {arrival.capitalize()} arrival: {items:,} items, 50 shapes"
                       + (", trickle at 1,500 items per simulated s" if arrival == "trickle" else "") + "\n\n"
                       + table(["figure", "FIFO stream (peer)", "conductor"], rows)
                       + f"\n\nConductor results: {recs['conductor'].complete}.\n")
    head = (f"## Shape lifecycle (issue 3)\n\nCommand: `{command_line()}`  \nMachine: {mach}  \n"
            f"Date: {now_utc()}, commit {git_rev()}  \nContract: 2 workers, {cfg.max_batch_size} items, "
            f"{cfg.max_batch_tokens:,} tokens, latch {cfg.high_water}/{cfg.low_water}; sim engine with one "
            "cached shape. Broker activations come from the model's state hash (`activations`); engine "
            "switches from the sim (a batch of a shape other than the one cached).\n")
    return head + "\n" + "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    text = run(args.quick)
    print(text)
    if not args.quick and not args.no_write:
        write_section("lifecycle", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
