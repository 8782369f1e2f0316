"""Issue 18's figures: the disk tier (conductor/tier/spill.py).

    .venv/bin/python -m bench.memory.disk_tier                 # full run (1e9 tokens), rewrites its RESULTS.md section
    .venv/bin/python -m bench.memory.disk_tier --quick         # small sizes, prints only
    .venv/bin/python -m bench.memory.disk_tier --packing 20000,100000   # issue 37's packing figure (its section)

One process, private redis-servers started here, a local directory as the store:

* Redis memory per waiting item: ``--per-item`` items (300-byte prompts) submitted to a fresh
  Redis without the tier (all in lanes) and with it (a ceiling of 200,000 tokens: nearly all in
  segments); used_memory after minus before, per item.
* submit rate: the same items into store segments (Conductor.submit with the tier), into Redis
  lanes (without it) and as a plain pipelined XADD of the same bytes (bench/broker/submit_claim.py's
  limit), items/s.
* the backlog: ``--tokens`` input tokens (items declare ``--item-tokens`` each, with short
  texts: the disk holds what the tier writes, not a billion tokens of text) through a Redis with
  maxmemory 256mb: submitted under a ``--ceiling``, then drained by a claimer thread (claim and
  complete, no engine: the fastest worker there is) while a feeder thread feeds (as the
  maintenance lease holder does). Reported: used_memory_peak through submit and drain; feed rate
  and claim rate; how often and how long the claimer found nothing while segments waited
  (starvation); every id once, in pure batches.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.broker.submit_claim import run_xadd  # noqa: E402
from bench.common.oracle import Item as OItem  # noqa: E402
from bench.common.oracle import cut_shape  # noqa: E402
from bench.common.report import command_line, git_rev, machine, now_utc, table, write_section  # noqa: E402
from bench.common.workload import WorkloadSpec, generate, make_items  # noqa: E402
from conductor.client import Conductor  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.formats.lines import parse_line  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402
from conductor.redis_contract.records import Batch, Contract, PreparedItem, Result  # noqa: E402
from conductor.tier.feeder import Feeder  # noqa: E402
from conductor.tier.object_store import Store  # noqa: E402
from conductor.tier.result_segments import offload_model  # noqa: E402

MODEL = "bench"
# resident_tokens for the per-item figures: items of ~150 tokens, so segments (a quarter of the
# ceiling) of some 300 items, and nearly all of 20,000 items in the store
TIER_CEILING = 200_000
RESULTS_WINDOW = 10_000  # result records kept in Redis for the backlog run; older ones move to the store


def _results(b: Batch) -> list[Result]:
    """One-token answers for every item of ``b``, as a worker writes them (the claimer of both drains)."""
    now = int(time.time() * 1000)
    return [
        Result(
            id=i.id,
            model=MODEL,
            job=i.job,
            output="o",
            output_tokens=1,
            error=None,
            shape=b.shape,
            epoch=b.epoch,
            lane=b.lane,
            batch=b.batch_id,
            batch_size=len(b.items),
            batch_padded_len=b.padded_len,
            input_tokens=i.input_tokens,
            worker="w",
            claimed_at=b.claimed_at,
            finished_at=now,
        )
        for i in b.items
    ]


def _quick_cfg(c: Conductor, **extra: int) -> None:
    c.ensure_model(MODEL)
    c.set_config(MODEL, {"quiet_ms": 50, "release_batches": 0, "activate_batches": 0, **extra})


def memory_per_item(n: int, store_dir: Path) -> dict[str, float]:
    items = make_items(n, shapes=4, seed=1, tag="mem")
    out = {}
    for name, ceiling in (("without the tier", 0), ("with the tier", TIER_CEILING)):
        with EmbeddedRedis() as srv:
            c = Conductor.from_url(srv.url, store=Store(str(store_dir / name.replace(" ", "_"))))
            _quick_cfg(c, resident_tokens=ceiling)
            before = c.r.info("memory")["used_memory"]
            c.submit(items, "j")
            out[name] = (c.r.info("memory")["used_memory"] - before) / n
    return out


def submit_rates(n: int, store_dir: Path) -> dict[str, float]:
    items = make_items(n, shapes=4, seed=2, tag="rate")
    out = {}
    for name in ("store segments (tier)", "Redis lanes (no tier)", "plain XADD pipeline (the limit)"):
        with EmbeddedRedis() as srv:
            c = Conductor.from_url(srv.url, store=Store(str(store_dir / f"rate{len(out)}")))
            _quick_cfg(c, resident_tokens=TIER_CEILING if name.startswith("store") else 0)
            t0 = time.perf_counter()
            if name.startswith("plain"):
                run_xadd(c.r, items, "j")
            else:
                rep = c.submit(items, "j")
                assert rep.accepted == n
            out[name] = n / (time.perf_counter() - t0)
    return out


def backlog_items(total_tokens: int, item_tokens: int, shapes: int) -> list[PreparedItem]:
    """Items of about ``item_tokens`` each until they declare ``total_tokens`` or more."""
    rng = random.Random(3)
    out: list[PreparedItem] = []
    total = 0
    while total < total_tokens:
        i = len(out)
        tok = max(1, int(item_tokens * rng.uniform(0.5, 1.5)))
        total += tok
        out.append(
            parse_line(
                json.dumps(
                    {
                        "id": f"b{i:08d}",
                        "model": MODEL,
                        "prefix": [f"shape {i % shapes}"],
                        "prompt": f"item {i}",
                        "input_tokens": tok,
                        "max_tokens": 8,
                    }
                )
            )
        )
    return out


def backlog(total_tokens: int, item_tokens: int, ceiling: int, store_dir: Path) -> dict[str, object]:
    items = backlog_items(total_tokens, item_tokens, shapes=4)
    sig_of = {it.id: it.sig for it in items}
    tokens = sum(it.input_tokens for it in items)
    res: dict[str, object] = {"items": len(items), "tokens": tokens}
    with EmbeddedRedis(extra=["--maxmemory", "256mb", "--maxmemory-policy", "noeviction"]) as srv:
        store = Store(str(store_dir / "backlog"))
        c = Conductor.from_url(srv.url, store=store)
        _quick_cfg(c, resident_tokens=ceiling, results_window=RESULTS_WINDOW)
        mk = K.ModelKeys(MODEL)
        t0 = time.perf_counter()
        for s in range(0, len(items), 5000):
            c.submit(items[s : s + 5000], "big")
        res["submit_s"] = time.perf_counter() - t0
        res["peak_after_submit"] = c.r.info("memory")["used_memory_peak"]
        res["store_bytes"] = sum(p.stat().st_size for p in (store_dir / "backlog").rglob("*.parquet"))
        res["segments"] = c.r.zcard(mk.segs)
        done = threading.Event()
        feeder_c = Conductor.from_url(srv.url, store=store)
        feeder = Feeder(feeder_c, store, MODEL)

        def feed() -> None:
            # as the maintenance lease holder does: feed often, move results past the window seldom
            next_offload = 0.0
            while not done.is_set():
                if time.monotonic() >= next_offload:
                    offload_model(feeder_c, store, MODEL)
                    next_offload = time.monotonic() + 1.0
                if feeder.feed() == 0:
                    time.sleep(0.001)

        th = threading.Thread(target=feed, daemon=True)
        th.start()
        contract = Contract(
            model=MODEL, max_batch_size=64, max_batch_tokens=64 * 2 * item_tokens, max_input_len=16_777_216
        )
        seen: set[str] = set()
        dup = impure = starved = 0
        starved_s = 0.0
        max_waiting = 0
        t0 = time.perf_counter()
        while True:
            b, why = c.claim(contract, "w")
            if b is None:
                intake = c.r.hmget(mk.intake, "tokens", "stored_tokens")
                waiting, stored = (int(v or 0) for v in intake)
                max_waiting = max(max_waiting, waiting)
                if why == "idle" or (waiting == 0 and stored == 0):
                    break
                if stored > 0 and waiting == 0:
                    starved += 1
                    t = time.perf_counter()
                    time.sleep(0.001)
                    starved_s += time.perf_counter() - t
                else:
                    time.sleep(0.001)
                continue
            if len({sig_of[i.id] for i in b.items}) != 1:
                impure += 1
            for i in b.items:
                dup += i.id in seen
                seen.add(i.id)
            c.complete(b, _results(b))
        drain_s = time.perf_counter() - t0
        done.set()
        th.join()
        res.update(
            drain_s=drain_s,
            claim_rate=len(seen) / drain_s,
            feed_rate=feeder.loaded_items / max(feeder.load_s, 1e-9),
            fed_items=feeder.loaded_items,
            fed_segments=feeder.loaded_segments,
            starved=starved,
            starved_s=starved_s,
            dup=dup,
            impure=impure,
            missing=len(items) - len(seen),
            peak_after_drain=c.r.info("memory")["used_memory_peak"],
            used_after_drain=c.r.info("memory")["used_memory"],
        )
        st = c.status("big")
        res["status"] = (st["completed"], st["failed"], st["pending"])
        res["result_segments"] = c.r.llen(mk.job_rsegs("big"))
        res["results_in_redis"] = c.r.xlen(mk.job_results("big"))
        t0 = time.perf_counter()
        read = [json.loads(x)["id"] for x in c.results("big")]
        res["read_results"], res["read_s"] = len(read), time.perf_counter() - t0
        res["read_distinct"] = len(set(read))
    return res


def oracle_waste(items: list[PreparedItem], size: int, budget: int, window: int = 0) -> float:
    """Padding waste of the offline oracle's cut (bench/common/oracle.py, rule 1) of ``items``.
    ``window`` > 0: each shape's items, in arrival order, cut into runs of at most that many tokens
    and each run cut on its own: an oracle that sees no more of a shape at a time than a disk tier
    whose ceiling is ``window`` holds (disjoint runs, where the tier's window rolls: a bound on what
    a ceiling costs, not a plan the tier could follow)."""
    by_sig: dict[str, list[OItem]] = {}
    for it in items:
        by_sig.setdefault(it.sig, []).append(OItem(it.id, it.sig, it.input_tokens, it.max_tokens))
    pad = act = 0
    for its in by_sig.values():
        runs: list[list[OItem]] = [[]]
        tokens = 0
        for oi in its:
            if window > 0 and runs[-1] and tokens + oi.tok > window:
                runs.append([])
                tokens = 0
            runs[-1].append(oi)
            tokens += oi.tok
        for run in runs:
            for b in cut_shape(run, 0, size, budget):
                pad += b.plen * len(b.items)
                act += sum(i.tok for i in b.items)
    return (pad - act) / pad


def _drain_packing(c: Conductor, feeder: Feeder, items: list[PreparedItem], size: int, budget: int) -> dict[str, float]:
    """One claimer drains the model while ``feeder`` feeds from the store in a thread; the
    batches' padding, the non-full batches' share and the shape lifecycle's counters."""
    mk = K.ModelKeys(MODEL)
    tok_of = {it.id: it.input_tokens for it in items}
    done = threading.Event()

    def feed() -> None:
        next_offload = 0.0
        while not done.is_set():
            if time.monotonic() >= next_offload:
                offload_model(feeder.c, feeder.store, MODEL)
                next_offload = time.monotonic() + 1.0
            if feeder.feed() == 0:
                time.sleep(0.001)

    th = threading.Thread(target=feed, daemon=True)
    th.start()
    contract = Contract(model=MODEL, max_batch_size=size, max_batch_tokens=budget, max_input_len=8192)
    seen: set[str] = set()
    pad = act = nb = partial = part_pad = part_act = 0
    t0 = time.perf_counter()
    while True:
        b, why = c.claim(contract, "w")
        if b is None:
            waiting, stored = (int(v or 0) for v in c.r.hmget(mk.intake, "tokens", "stored_tokens"))
            if why == "idle" or (waiting == 0 and stored == 0):
                break
            time.sleep(0.002)
            continue
        nb += 1
        padded, actual = b.padded_len * len(b.items), sum(tok_of[i.id] for i in b.items)
        pad, act = pad + padded, act + actual
        if len(b.items) < size and (len(b.items) + 1) * b.padded_len <= budget:  # room for one more
            partial, part_pad, part_act = partial + 1, part_pad + padded, part_act + actual
        seen.update(i.id for i in b.items)
        c.complete(b, _results(b))
    drain_s = time.perf_counter() - t0
    done.set()
    th.join()
    fields = ("activations", "hygiene_drains", "shapes_finished", "neighbour_fills")
    out = {k: float(int(v or 0)) for k, v in zip(fields, c.r.hmget(mk.state, *fields), strict=True)}
    out.update(
        waste=(pad - act) / pad if pad else float("nan"),
        batches=nb,
        not_full=partial,
        not_full_tokens=part_pad / max(1, pad),
        not_full_waste_share=(part_pad - part_act) / max(1, pad - act),
        items=len(seen),
        fed_segments=feeder.loaded_segments,
        drain_s=drain_s,
    )
    return out


def packing(
    n: int, ceiling: int, store_dir: Path, maxmemory: str = "64mb", seed: int = 7, cfg: dict[str, str] | None = None
) -> dict[str, dict[str, float]]:
    """Issue 37's figure: padding waste of the batches one claimer gets, the same ``n`` items (the
    packing suite's workload: 50 Zipf shapes, lognormal suffixes) submitted with the tier (``ceiling``:
    most of them through store segments, fed back by a feeder thread) and without it (all in lanes),
    against the offline oracle's cut of the same items under the same contract (64 items, 65,536
    tokens, as bench/packing/suite.py's), in a Redis of ``maxmemory``."""
    wl = generate(WorkloadSpec(items=n, model=MODEL, seed=seed))
    size, budget = 64, 65_536
    out: dict[str, dict[str, float]] = {
        "oracle": {"waste": oracle_waste(wl.items, size, budget)},
        "oracle_window": {"waste": oracle_waste(wl.items, size, budget, window=ceiling)},
    }
    for name, ceil in (("tier", ceiling), ("resident", 0)):
        with EmbeddedRedis(extra=["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"]) as srv:
            store = Store(str(store_dir / f"pack-{name}"))
            c = Conductor.from_url(srv.url, store=store)
            c.ensure_model(MODEL)
            # the claimer's contract as the model's reference budget, as a worker's registration makes
            # it (lua/register.lua); the claimer here registers no worker, and readiness under the
            # default 8,192 tokens cuts streamed lanes short (bench/RESULTS.md, issue 37)
            c.set_config(MODEL, {"resident_tokens": ceil, "budget_tokens": budget, "budget_items": size, **(cfg or {})})
            for s in range(0, len(wl.items), 5000):
                c.submit(wl.items[s : s + 5000], "pack")
            fc = Conductor.from_url(srv.url, store=store)
            out[name] = _drain_packing(c, Feeder(fc, store, MODEL), wl.items, size, budget)
        print(name, out[name], flush=True)
    return out


def packing_figures(a: argparse.Namespace) -> None:
    """--packing: each size ``--repeat`` times, medians, printed and (unless --no-write) written."""
    rows = []
    cfg = dict(kv.split("=", 1) for kv in a.cfg.split(",") if kv)
    for n in (int(x) for x in a.packing.split(",") if x):
        runs = []
        for _ in range(max(1, a.repeat)):
            d = Path(tempfile.mkdtemp(prefix="cdr-tier-pack-"))
            try:
                runs.append(packing(n, a.ceiling, d, cfg=cfg))
            finally:
                shutil.rmtree(d, ignore_errors=True)
        o, ow = runs[0]["oracle"]["waste"], runs[0]["oracle_window"]["waste"]
        goal = 1.1 * o + 0.001

        def med(name: str, key: str, runs: list[dict[str, dict[str, float]]] = runs) -> float:
            return statistics.median(r[name][key] for r in runs)

        def span(name: str, runs: list[dict[str, dict[str, float]]] = runs) -> str:
            ws = sorted(r[name]["waste"] for r in runs)
            return f"{med(name, 'waste'):.2%} ({ws[0]:.3%}-{ws[-1]:.3%})"

        for name in ("tier", "resident"):
            print(f"{n:,} items {name:9s} waste {span(name)}  oracle {o:.3%}  goal <= {goal:.3%}  "
                  f"oracle per ceiling-sized run {ow:.3%}", flush=True)
        rows.append((
            f"{n:,}", span("tier"), span("resident"), f"{o:.2%}", f"{goal:.2%}", f"{ow:.2%}",
            "met" if med("tier", "waste") <= goal else "**missed**",
            "met" if med("resident", "waste") <= goal else "**missed**",
            f"{med('tier', 'activations'):.0f} / {med('tier', 'batches'):.0f} ({med('tier', 'not_full'):.0f} not full)",
            f"{med('resident', 'batches'):.0f} ({med('resident', 'not_full'):.0f} not full)",
        ))
    body = (
        f"## Disk tier packing against the oracle (issue 37)\n\n{now_utc()}, commit {git_rev()}, {machine()}.\n\n"
        f"`.venv/bin/python -m bench.memory.disk_tier {shlex.join(sys.argv[1:])}`\n\n"
        f"The packing suite's workload (50 Zipf shapes, lognormal suffixes, seed 7), contract 64 items / 65,536 "
        f"tokens (the model's reference budget too), one claimer (claim and complete, no engine), a 64 MB Redis: "
        f"the same items with the tier (resident_tokens {a.ceiling:,}, the rest through store segments, fed "
        f"back by a feeder thread) and without it (all in lanes), against the offline oracle's cut of the same "
        f"items (bench/common/oracle.py rule 1). Medians of {max(1, a.repeat)} runs (range in brackets); the "
        f"resident path is deterministic, the tier varies with its feeder thread's timing. \"Oracle per "
        f"ceiling-sized run\": the oracle cutting each shape's items in arrival-order runs of at most "
        f"resident_tokens tokens (what a ceiling lets anything see of a shape at a time; disjoint runs, so "
        f"a bound, not a plan)."
        f"{' Config: ' + a.cfg + '.' if a.cfg else ''}\n\n"
        + table(["items", "tier waste", "resident waste", "oracle", "goal (1.1x + 0.1 pt)",
                 "oracle per ceiling-sized run", "tier goal", "resident goal",
                 "tier activations / batches", "resident batches"], rows)
        + "\n"
    )
    print(body)
    if not a.no_write:
        write_section("disk-tier-packing", body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=1_000_000_000)
    ap.add_argument("--item-tokens", type=int, default=10_000)
    ap.add_argument("--ceiling", type=int, default=4_000_000)
    ap.add_argument("--per-item", type=int, default=20_000)
    ap.add_argument(
        "--packing",
        default="",
        metavar="N[,N...]",
        help="only issue 37's figure: padding waste of N items (each N in turn) with the tier (--ceiling) and "
        "without, against the oracle; medians of --repeat runs, written to its RESULTS.md section (disk-tier-packing)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="--packing: runs per size (medians)")
    ap.add_argument("--no-write", action="store_true", help="--packing: print only")
    ap.add_argument("--cfg", default="", metavar="K=V,...", help="--packing: model config fields set before submitting")
    a = ap.parse_args()
    if a.packing:
        packing_figures(a)
        return
    if a.quick:
        a.tokens, a.per_item = 20_000_000, 2000
    d = Path(tempfile.mkdtemp(prefix="cdr-tier-bench-"))
    try:
        mem = memory_per_item(a.per_item, d)
        print("memory per item", mem, flush=True)
        rates = submit_rates(a.per_item, d)
        print("submit rates", rates, flush=True)
        big = backlog(a.tokens, a.item_tokens, a.ceiling, d)
        print("backlog", big, flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    mib = 2**20
    body = (
        f"## Disk tier: a backlog beyond Redis memory (issue 18)\n\n{now_utc()}, commit {git_rev()}, "
        f"{machine()}.\n\n`{command_line()}`\n\n"
        f"**Backlog**: {big['items']:,} items declaring {big['tokens']:,} input tokens (about "
        f"{a.item_tokens:,} each, short texts), 4 shapes, resident_tokens {a.ceiling:,}, a Redis with "
        f"maxmemory 256mb, a local directory as the store, results_window {RESULTS_WINDOW:,}; drained by one "
        f"claimer (claim and complete, no engine) while a feeder thread feeds and moves results past the window "
        f"(as the maintenance lease holder does).\n\n"
        + table(
            ["figure", "value"],
            [
                ("used_memory_peak through submit", f"{big['peak_after_submit'] / mib:.1f} MiB"),
                ("used_memory_peak through submit and drain", f"{big['peak_after_drain'] / mib:.1f} MiB"),
                (
                    "used_memory after the drain (done marks, id registry, the results window)",
                    f"{big['used_after_drain'] / mib:.1f} MiB",
                ),
                (
                    "results: in Redis (results_window), in store segments",
                    f"{big['results_in_redis']:,}, {big['result_segments']:,} segments",
                ),
                (
                    "`Conductor.results` over store and Redis: records, time",
                    f"{big['read_results']:,} ({big['read_distinct']:,} distinct ids), {big['read_s']:.1f} s",
                ),
                ("store: segments, bytes", f"{big['segments']:,}, {big['store_bytes'] / mib:.1f} MiB"),
                (
                    "submit (to Redis up to the ceiling, the rest to segments)",
                    f"{big['submit_s']:.1f} s, {big['items'] / big['submit_s']:,.0f} items/s",
                ),
                ("drain", f"{big['drain_s']:.1f} s"),
                ("claim rate (items/s)", f"{big['claim_rate']:,.0f}"),
                ("feed rate: items loaded per second spent loading", f"{big['feed_rate']:,.0f}"),
                ("items fed from segments", f"{big['fed_items']:,} in {big['fed_segments']:,} segments"),
                (
                    "claims that found no batch while segments waited (starved)",
                    f"{big['starved']:,} ({big['starved_s']:.2f} s of {big['drain_s']:.1f} s)",
                ),
                ("ids missing, duplicated; impure batches", f"{big['missing']}, {big['dup']}; {big['impure']}"),
                ("status: completed, failed, pending", ", ".join(str(x) for x in big["status"])),  # type: ignore[attr-defined]
            ],
        )
        + f"\n\n**Redis memory per waiting item** ({a.per_item:,} items of ~300 bytes, 4 shapes):\n\n"
        + table(["", "bytes per item"], [(k, f"{v:,.0f}") for k, v in mem.items()])
        + f"\n\n(with the tier: resident_tokens {TIER_CEILING:,}.) With the tier a waiting item costs Redis its "
        "16-byte record in the job's stored ids (`M:in:J:stored`, kept for idempotent re-submits; schema 5 "
        "kept a registry entry `id -> 's<seq>:<sum>'` of about 80 bytes), its name in its segment's id list "
        "(`M:seg:N:ids`) and a share of one index record per segment.\n\n"
        + f"**Submit rate** ({a.per_item:,} items of ~300 bytes, items/s):\n\n"
        + table(["into", "items/s"], [(k, f"{v:,.0f}") for k, v in rates.items()])
        + "\n"
    )
    print(body)
    if not a.quick:
        write_section("disk-tier", body)


if __name__ == "__main__":
    main()
