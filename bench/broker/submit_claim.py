"""Issue 2's benchmark: submit items/s against RQ and the plain-XADD limit; claim round trip.

    .venv/bin/python bench/broker/submit_claim.py            # full run, rewrites its RESULTS.md section
    .venv/bin/python bench/broker/submit_claim.py --quick    # small sizes, prints only

Everything runs in ONE process against a private redis-server started here (EmbeddedRedis),
so the peers and the limit are measured on the same server in the same minute:

* submit: ``Conductor.submit`` (bulk, pipelined submit.lua calls) vs RQ 2.12.0's
  ``Queue.enqueue_many`` (JSONSerializer, the pinned version in the ``bench`` extra) vs a plain
  redis-py pipeline of XADDs carrying the same fields and bytes (the limit). Systems are
  interleaved within each repetition; figures are medians over the repetitions. Client CPU
  (``time.process_time``) and server time (INFO commandstats) split each run.
* claim: 64-item batches of ~300-byte items from a backlog that stays at or above the
  ``--backlog`` size, timed per call: ``Conductor.claim`` (with decoding into BatchItems), the
  same round trip with its replies left undecoded (claim.lua plus the pipelined LRANGE of the
  batch's items) and a bare XREADGROUP COUNT 64 of the same bytes from a plain stream (the
  floor, through redis-py and with the raw reply), interleaved call by call.
"""

from __future__ import annotations

import argparse
import gc
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402

from bench.common.report import command_line, git_rev, machine, median, now_utc, pct, publish, table  # noqa: E402
from bench.common.workload import make_items  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402
from conductor.redis_contract.records import (
    Contract,  # noqa: E402
    PreparedItem,  # noqa: E402
)

MODEL = "bench"


def server_stats(r: redis.Redis) -> dict[str, dict]:
    return r.info("commandstats")


def cmd_usec(stats: dict, name: str) -> tuple[float, int]:
    row = stats.get(f"cmdstat_{name}") or {}
    return float(row.get("usec", 0)), int(row.get("calls", 0))


# ---------------------------------------------------------------------------------- submit
def run_conductor(r: redis.Redis, items: list[PreparedItem], job: str) -> None:
    c = Conductor(r)
    rep = c.submit(items, job)
    assert rep.accepted == len(items), rep


def run_rq(r: redis.Redis, items: list[PreparedItem], job: str, chunk: int = 1000) -> None:
    from rq import Queue
    from rq.serializers import JSONSerializer
    q = Queue("bench", connection=r, serializer=JSONSerializer)
    for s in range(0, len(items), chunk):
        q.enqueue_many([Queue.prepare_data("bench.rq_fifo.run_item",
                                           args=(it.id, job, it.sig, it.input_tokens, it.max_tokens,
                                                 it.body.decode()))
                        for it in items[s:s + chunk]])


def run_xadd(r: redis.Redis, items: list[PreparedItem], job: str, chunk: int = 1000) -> None:
    key = "plain:stream"
    for s in range(0, len(items), chunk):
        pipe = r.pipeline(transaction=False)
        for it in items[s:s + chunk]:
            pipe.xadd(key, {"id": it.id, "job": job, "sig": it.sig, "tok": it.input_tokens,
                            "mt": it.max_tokens, "d": it.body})
        pipe.execute()


SUBMITTERS: dict[str, Callable[[redis.Redis, list[PreparedItem], str], None]] = {
    "conductor": run_conductor, "rq": run_rq, "xadd": run_xadd}


def bench_submit(r: redis.Redis, n: int, reps: int, shapes: int) -> dict[str, dict[str, list[float]]]:
    items = make_items(n, shapes=shapes, seed=1, tag="s")
    out: dict[str, dict[str, list[float]]] = {k: {"rate": [], "client_us": [], "server_us": [], "wall_s": []}
                                              for k in SUBMITTERS}
    for rep in range(reps):
        order = list(SUBMITTERS)
        order = order[rep % len(order):] + order[:rep % len(order)]
        for name in order:
            r.flushall()
            r.config_resetstat()
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            SUBMITTERS[name](r, items, f"job{rep}")
            wall, client = time.perf_counter() - t0, time.process_time() - c0
            stats = server_stats(r)
            server = sum(float(v.get("usec", 0)) for v in stats.values())
            out[name]["rate"].append(n / wall)
            out[name]["wall_s"].append(wall)
            out[name]["client_us"].append(client * 1e6 / n)
            out[name]["server_us"].append(server / n)
            print(f"  submit rep {rep} {name:10s} {n / wall:9.0f} items/s  client {client * 1e6 / n:6.1f} us/item"
                  f"  server {server / n:6.1f} us/item", flush=True)
    return out


# ---------------------------------------------------------------------------------- claim
def bench_claim(r: redis.Redis, backlog: int, claims: int, batch: int) -> dict[str, object]:  # noqa: C901 - one timed run, phases inline so the timings read top to bottom
    r.flushall()
    c = Conductor(r)
    budget = batch * 512  # every item is under 512 tokens: batches close on their item count
    c.set_config(MODEL, {"release_batches": 0, "activate_batches": 0, "quiet_ms": 600_000,
                         "budget_tokens": budget, "budget_items": batch})
    # Two of the timed calls consume a batch from the backlog, which never drops under --backlog.
    total = backlog + (2 * claims + 60) * batch
    items = make_items(total, shapes=1, seed=2, tag="c", mu=4.6, sigma=0.25)
    t0 = time.perf_counter()
    for s in range(0, total, 20_000):
        c.submit(items[s:s + 20_000], "claimjob")
    print(f"  claim backlog: {total} items submitted in {time.perf_counter() - t0:.1f} s", flush=True)
    floor_key = "plain:floor"
    for s in range(0, total, 2000):
        pipe = r.pipeline(transaction=False)
        for it in items[s:s + 2000]:
            pipe.xadd(floor_key, {"id": it.id, "job": "claimjob", "tok": it.input_tokens, "mt": it.max_tokens,
                                  "d": it.body})
        pipe.execute()
    r.xgroup_create(floor_key, "g", id="0")
    contract = Contract(model=MODEL, max_batch_size=batch, max_batch_tokens=budget, max_input_len=100_000)
    mk = K.ModelKeys(MODEL)
    keys = [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed]
    args = ["raw", batch, budget]

    # Each call returns what it read, so freeing it (the caller's business, after its work)
    # falls outside the timed span; the int is the batch size where there is one.
    def conductor_claim() -> tuple[int, object]:
        b, why = c.claim(contract, "lib")
        assert b is not None, why
        return len(b.items), b

    def raw_claim() -> tuple[int, object]:
        # The same round trip Conductor.claim makes (claim.lua, then LRANGE of the batch's items),
        # replies left undecoded.
        token = secrets.token_hex(8)
        reply, recs = c._send_two(("EVALSHA", c.scripts.claim.sha, len(keys), *keys, *args, token),
                                  ("LRANGE", mk.batch_items(token), 0, -1))
        assert reply[0] == 1 and len(recs) == reply[9], reply
        return -1, recs

    def floor_read() -> tuple[int, object]:
        reply = r.xreadgroup("g", "f", {floor_key: ">"}, count=batch)
        return (-1 if reply else 0), reply

    raw_conn = r.connection_pool.get_connection()

    def floor_raw() -> tuple[int, object]:
        # hiredis parses the reply in C; redis-py's per-entry callbacks (dicts of fields) are skipped.
        raw_conn.send_command("XREADGROUP", "GROUP", "g", "f", "COUNT", batch, "STREAMS", floor_key, ">")
        reply = raw_conn.read_response(disable_decoding=True)
        return (-1 if reply else 0), reply

    # A worker does not hold the producer's 100,000 items: drop them, so a full collection of
    # the benchmark's own heap does not land in the claim's tail.
    del items
    gc.collect()
    gc.freeze()
    calls = {"conductor.claim": conductor_claim, "claim round trip, undecoded": raw_claim,
             "XREADGROUP COUNT 64 (floor)": floor_read, "XREADGROUP COUNT 64, raw reply (floor)": floor_raw}
    for fn in calls.values():  # warm up: script cache, connection, prefix cache
        for _ in range(15):
            fn()
    r.config_resetstat()
    lat: dict[str, list[float]] = {k: [] for k in calls}
    sizes: list[int] = []
    gc.collect()
    names = list(calls)
    for i in range(claims):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter_ns()
            got, kept = calls[name]()
            lat[name].append((time.perf_counter_ns() - t) / 1000)
            del kept
            if got > 0:
                sizes.append(got)
    stats = server_stats(r)
    ev_usec, ev_calls = cmd_usec(stats, "evalsha")
    xr_usec, xr_calls = cmd_usec(stats, "xreadgroup")
    r.connection_pool.release(raw_conn)
    left = int(r.hget(mk.intake, "items") or 0)
    return {"lat": lat, "sizes": sizes, "server_claim_us": ev_usec / max(1, ev_calls),
            "server_xread_us": xr_usec / max(1, xr_calls), "xread_calls": xr_calls, "claim_calls": ev_calls,
            "backlog_left": left, "total": total}


# ---------------------------------------------------------------------------------- report
def report(args: argparse.Namespace, mach: str, sub: dict, clm: dict, why: dict | None = None) -> str:
    lim = median(sub["xadd"]["rate"])
    rows = []
    for name, label in (("conductor", "conductor (Conductor.submit, bulk submit.lua)"),
                        ("rq", "RQ 2.12.0 enqueue_many (JSONSerializer)"),
                        ("xadd", "plain pipelined XADD, same bytes (the limit)")):
        d = sub[name]
        rows.append([label, f"{median(d['rate']):,.0f}", f"{min(d['rate']):,.0f} .. {max(d['rate']):,.0f}",
                     f"{median(d['rate']) / lim:.2f}x", f"{median(d['client_us']):.1f}",
                     f"{median(d['server_us']):.1f}"])
    ratio = median(sub["conductor"]["rate"]) / lim
    # Each repetition runs the systems back to back: their ratio within a repetition is less
    # exposed to load that comes and goes on a shared machine than the ratio of medians.
    paired = [c / x for c, x in zip(sub["conductor"]["rate"], sub["xadd"]["rate"], strict=True)]
    crow = []
    for name, xs in clm["lat"].items():
        crow.append([name, f"{pct(xs, 50):.0f}", f"{pct(xs, 90):.0f}", f"{pct(xs, 99):.0f}", f"{max(xs):.0f}"])
    c50, c99 = pct(clm["lat"]["conductor.claim"], 50), pct(clm["lat"]["conductor.claim"], 99)
    r50, r99 = pct(clm["lat"]["claim round trip, undecoded"], 50), pct(clm["lat"]["claim round trip, undecoded"], 99)
    f50 = pct(clm["lat"]["XREADGROUP COUNT 64 (floor)"], 50)
    sizes = clm["sizes"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return "\n".join([
        "## Submit and claim (issue 2)",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {mach}  ",
        f"Date: {now_utc()}, commit {git_rev()}  ",
        "Server: a private redis-server started by the benchmark (EmbeddedRedis), no persistence, "
        "same host as the client (2 cores shared with other work: expect noise).",
        "",
        f"### Submit: {args.items:,} items of about 300 bytes, {args.shapes} shapes, "
        f"median of {args.reps} repetitions",
        "",
        table(["system", "items/s (median)", "range", "vs limit", "client CPU us/item", "server us/item"], rows),
        "",
        f"Goal conductor >= 0.8x the plain-XADD limit: **{ratio:.2f}x, {verdict(ratio >= 0.8)}** (ratio of "
        f"medians; within each repetition: {', '.join(f'{x:.2f}' for x in paired)}, median "
        f"{median(paired):.2f}x). "
        "Client CPU is `time.process_time()` of the submitting process; server time is the sum of "
        "INFO commandstats usec over the run (for the conductor: submit.lua inside EVALSHA).",
        "",
        f"### Claim: {args.batch}-item batches from a backlog of >= {args.backlog:,} items, "
        f"{args.claims} calls each, interleaved",
        "",
        table(["call", "p50 us", "p90 us", "p99 us", "max us"], crow),
        "",
        f"Server time per call (INFO commandstats usec_per_call): claim.lua (EVALSHA) "
        f"**{clm['server_claim_us']:.0f} us**, bare XREADGROUP COUNT {args.batch} "
        f"**{clm['server_xread_us']:.0f} us**. Batch size p50/min: {pct(sizes, 50):.0f}/{min(sizes)} items; "
        f"items left in the backlog after timing: {clm['backlog_left']:,}.",
        "",
        f"Goals (Conductor.claim round trip): p50 <= 500 us: **{c50:.0f} us, {verdict(c50 <= 500)}**; "
        f"p99 <= 1 ms: **{c99:.0f} us, {verdict(c99 <= 1000)}**. The bare script call: p50 {r50:.0f} us, "
        f"p99 {r99:.0f} us; the floor p50 {f50:.0f} us (claim p50 / floor p50 = {c50 / f50:.2f}x).",
        *(_why_lines(why) if why else []),
    ])


def _why_lines(why: dict) -> list[str]:
    from bench.profiles import claim_profile, submit_profile
    sp = why["submit"]
    return [
        "",
        "### Where the server time goes (copies of the scripts, measured in the same run)",
        "",
        f"submit.lua, {sp['chunk']:,} items per call, {sp['shapes']} shapes sent grouped by shape as "
        "Conductor.submit sends them, median of the repetitions "
        "(`bench/profiles/submit_profile.py`):",
        "",
        submit_profile.as_markdown(sp),
        "",
        "claim.lua, 64-item batches, phases of one claim from an instrumented copy called in turn with "
        "the script as is on one backlog (`bench/profiles/claim_profile.py`):",
        "",
        claim_profile.as_markdown(why["claim"]),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, help="items per submit repetition (50,000; quick 2,000)")
    p.add_argument("--reps", type=int, help="submit repetitions (5; quick 2)")
    p.add_argument("--shapes", type=int, default=20)
    p.add_argument("--backlog", type=int, help="claim backlog floor (100,000; quick 2,000)")
    p.add_argument("--claims", type=int, help="timed calls of each kind (1,000; quick 50)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="small sizes; prints, writes nothing")
    p.add_argument("--no-write", action="store_true", help="do not rewrite bench/RESULTS.md")
    p.add_argument("--no-why", action="store_true", help="skip the script profiles (on by default, off in quick)")
    args = p.parse_args(argv)
    sizes = {"items": 2000, "reps": 2, "backlog": 2000, "claims": 50} if args.quick else \
        {"items": 50_000, "reps": 5, "backlog": 100_000, "claims": 1000}
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.no_write = args.no_write or args.quick
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        mach = machine(r)
        print(f"redis-server on port {srv.port}; {mach}", flush=True)
        sub = bench_submit(r, args.items, args.reps, args.shapes)
        clm = bench_claim(r, args.backlog, args.claims, args.batch)
        why = None
        if not (args.quick or args.no_why):
            from bench.profiles import claim_profile, submit_profile
            from conductor.client.submit_stream import SUBMIT_CHUNK
            r.flushall()
            why = {"submit": submit_profile.profile(r, 20_000, 3, SUBMIT_CHUNK, shapes=args.shapes),
                   "claim": claim_profile.profile(r, 0, 400)}
        text = report(args, mach, sub, clm, why)
    publish(text, "submit_claim", write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

