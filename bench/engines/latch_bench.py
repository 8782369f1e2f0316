"""Seed 000 with the sim engine: an overloaded worker with the admission latch off and on,
next to the engine's unloaded rate, all in one run.

Everything is in SIMULATED GPU time (the sim engine's clock: prefill, decode steps, recompute
after preemption); Redis and Python time are not counted. The work goes through the real
path (submit.lua, claim.lua, the Worker loop, complete.lua) on a private redis-server.

* engine: SimEngine with a KV capacity of ``--kv-capacity`` tokens (defaults in SimParams
  otherwise). A sequence holds its padded prompt plus its generated tokens; past the
  capacity the engine preempts (``--preempt largest|newest``) and recomputes later.
* unloaded: the engine driven directly, never over its memory: a closed loop that keeps
  K = capacity // (padded prompt + max_tokens) sequences alive, admitting one when one ends.
* overload, latch off: every item queued at once, the worker pulls whenever it can.
* overload, latch on: the same backlog, ``--high-water K --low-water K - K/8``.

Goal (issue 4): with the latch, finished sequences/s >= 90 % of the unloaded rate.
Run: .venv/bin/python bench/engines/latch_bench.py [--items 3000] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.report import command_line, git_rev, machine, now_utc, table, write_section  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.formats.lines import parse_line  # noqa: E402
from conductor.redis_contract.records import Batch, BatchItem  # noqa: E402
from conductor.workers.engines.sim import SimEngine, SimParams  # noqa: E402
from conductor.workers.worker import Worker, WorkerOptions  # noqa: E402

MODEL = "latch-bench"
PROMPT_TOKENS = 120  # one lane: padded to 120
MAX_TOKENS = 256


def engine(args: argparse.Namespace) -> SimEngine:
    # max_num_seqs 0: an engine that runs whatever it is given (seed 000's), the latch alone bounds it
    return SimEngine(MODEL, max_batch_size=args.batch, max_batch_tokens=8192, max_input_len=4096, max_num_seqs=0,
                     params=SimParams(kv_capacity_tokens=args.kv_capacity, preempt=args.preempt))


def figures(name: str, eng: SimEngine, wall: float, extra: str = "") -> dict:
    c = eng.counters
    s = c.sim_seconds
    return {"run": name, "finished": c.finished, "sim_s": s, "finished_per_s": c.finished / s,
            "decode_tokens_per_s": c.output_tokens / s, "useful_tokens_per_s": c.useful_output_tokens / s,
            "all_tokens_per_s": (c.output_tokens + c.prefill_tokens) / s, "preemptions": c.preemptions,
            "lost_tokens": c.lost_tokens, "recompute_tokens": c.recompute_tokens, "wall_s": wall, "note": extra}


def unloaded(args: argparse.Namespace, k: int) -> dict:
    eng = engine(args)
    t = time.monotonic()
    admitted = 0

    def admit_one() -> None:
        nonlocal admitted
        it = BatchItem(id=f"u{admitted}", job="u", input_tokens=PROMPT_TOKENS, max_tokens=MAX_TOKENS, prompt="x")
        b = Batch(model=MODEL, batch_id=f"{admitted}-0", shape="S", epoch=1, lane=0, padded_len=PROMPT_TOKENS,
                  max_tokens=MAX_TOKENS, claimed_at=0, items=[it], prefix=["system"])
        eng.admit(b, [it])
        admitted += 1

    while admitted < min(k, args.items):
        admit_one()
    while eng.active():
        for _ in eng.step():
            if admitted < args.items:
                admit_one()
    return figures("unloaded (closed loop, K alive)", eng, time.monotonic() - t, f"K = {k}")


def overload(args: argparse.Namespace, url: str, high: int | None, low: int | None, sim_limit: float) -> dict:
    c = Conductor(connect(url))
    c.r.flushall()
    c.set_config(MODEL, {"quiet_ms": 50, "release_batches": 0, "activate_batches": 0})
    lines = [json.dumps({"id": f"i{i}", "model": MODEL, "prefix": ["system"], "prompt": "x",
                         "input_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS}) for i in range(args.items)]
    for start in range(0, len(lines), 2000):
        c.submit([parse_line(x) for x in lines[start:start + 2000]], "bench")
    eng = engine(args)
    w = Worker(c, eng, WorkerOptions(name="bench", high_water=high, low_water=low))
    w.register()
    t = time.monotonic()
    peak = 0
    while True:
        w.turn()
        peak = max(peak, eng.active())
        if eng.counters.finished >= args.items and not w.retry:
            break
        if eng.counters.sim_seconds > sim_limit:  # a thrashing engine may never finish: stop the clock
            break
    w.turn()
    name = "overload, latch off" if high is None else f"overload, latch on ({high}/{low})"
    stopped = "" if eng.counters.finished >= args.items else f", stopped at the {sim_limit:.0f} s window"
    out = figures(name, eng, time.monotonic() - t, f"peak active {peak}{stopped}")
    out["results"] = c.status("bench")["completed"]
    out["transitions"] = w.latch.transitions
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=3000)
    ap.add_argument("--kv-capacity", type=int, default=32768)
    ap.add_argument("--preempt", choices=["largest", "newest"], default="largest")
    ap.add_argument("--batch", type=int, default=32, help="the engine's max batch size (items per pull)")
    ap.add_argument("--window", type=float, default=3.0,
                    help="stop an overload run after this many times the unloaded run's simulated time")
    ap.add_argument("--also-newest", action="store_true", help="add a latch-off run with --preempt newest")
    ap.add_argument("--write-results", action="store_true", help="rewrite this section of bench/RESULTS.md")
    args = ap.parse_args()
    k = args.kv_capacity // (PROMPT_TOKENS + MAX_TOKENS)
    high, low = k, k - max(1, k // 8)
    runs = [unloaded(args, k)]
    limit = args.window * runs[0]["sim_s"]
    with EmbeddedRedis() as srv:
        mach = machine(connect(srv.url))
        runs.append(overload(args, srv.url, None, None, limit))
        if args.also_newest:
            alt = argparse.Namespace(**{**vars(args), "preempt": "newest"})
            r = overload(alt, srv.url, None, None, limit)
            r["run"] += " (preempt newest)"
            runs.append(r)
        runs.append(overload(args, srv.url, high, low, limit))
    base = runs[0]["finished_per_s"]
    rows = [[r["run"], r["finished"], f"{r['sim_s']:.1f}", f"{r['finished_per_s']:.1f}",
             f"{100 * r['finished_per_s'] / base:.0f} %", f"{r['decode_tokens_per_s']:,.0f}",
             f"{r['useful_tokens_per_s']:,.0f}", f"{r['all_tokens_per_s']:,.0f}", f"{r['preemptions']:,}",
             f"{r['lost_tokens']:,}", r["note"]] for r in runs]
    header = ["run", "finished", "sim s", "finished seq/s", "vs unloaded", "decode tok/s", "useful tok/s",
              "prefill+decode tok/s", "preemptions", "tokens lost", "note"]
    on = runs[-1]["finished_per_s"] / base
    body = "\n".join([
        "## Admission latch under overload (issue 4, seed 000)", "",
        f"Command: `{command_line()}`  ",
        f"Machine: {mach}  ",
        f"Date: {now_utc()}, commit {git_rev()}  ",
        f"Workload: {args.items} items, {PROMPT_TOKENS} prompt tokens (one lane, one shape), max_tokens "
        f"{MAX_TOKENS} (sim output 64..256), engine batch {args.batch}; sim KV capacity {args.kv_capacity} tokens, "
        f"preempt `{args.preempt}`; K = {k}, latch {high}/{low}. All rates in SIMULATED seconds "
        "(the sim engine's cost model, workers/engines/sim.py), not wall time.", "",
        table(header, rows), "",
        f"Goal: latch on >= 90 % of the unloaded finished-sequence rate: **{100 * on:.0f} %, "
        f"{'met' if on >= 0.9 else 'NOT met'}**. Latch off: "
        f"{100 * runs[1]['finished_per_s'] / base:.0f} % of it, while its decode tokens/s is "
        f"{runs[1]['decode_tokens_per_s'] / runs[-1]['decode_tokens_per_s']:.2f}x the latched run's.",
        "decode tok/s counts every decoded token, also those a preemption threw away; useful tok/s only the "
        "output of sequences that finished.",
    ])
    print(body)
    if args.write_results:
        write_section("latch_bench", body)
    return 0 if on >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
