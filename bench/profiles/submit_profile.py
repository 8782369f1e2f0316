"""Where submit.lua spends its server time: copies with one part taken out (the file is never
changed), each submitting the same items to its own model on one server, call by call in turn.

    .venv/bin/python bench/profiles/submit_profile.py [--items 30000] [--reps 3] [--chunk 1000]

Copies: ``as is``; ``no lane counters`` (the per-lane hash, fill, ready and touch updates at
the end of a call are skipped); ``no dedupe`` (the job's id hash is neither read nor written); ``no content sums`` (no
SHA-1 per item, nothing written to the job's sums hash);
``no lane appends`` (the two RPUSHes per touched lane are skipped); ``no lane choice`` (every
item joins lane 0); ``record decoded twice`` (the check's cjson.decode runs a second time: the
check cannot be cut, its result supplies id and tokens). For a cut, the difference to ``as is``
is what that part costs per item; for the doubled decode, the difference is what the decode
costs (median of SLOWLOG's per-call time / items per call). Items go in chunks grouped by shape,
as Conductor.submit sends them. A copy whose anchor line is gone from submit.lua is skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402

from bench.common.report import median  # noqa: E402
from bench.common.workload import make_items  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.client.submit_stream import grouped_by_shape  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract.script_calls import submit_args  # noqa: E402
from conductor.redis_contract.scripts import source  # noqa: E402

# name -> (anchor, replacement) pairs; each anchor must occur once in submit.lua as loaded (its
# includes inlined). A copy whose anchor is gone is skipped and named; tests/test_bench_smoke.py
# fails then, so the cuts follow the script.
CUTS = {
    "no lane counters": [("  for _, lane in ipairs(ctx.order) do\n", "  for _, lane in ipairs({}) do\n")],
    "no dedupe": [("  local known = redis.call('HMGET', job_sums, unpack(ids))\n", "  local known = {}\n"),
                  ("hset_pairs(job_sums, fresh_sums)\n", "")],
    # the sums the producer sends (script_calls.submit_args) are read, not computed: the cut skips
    # reading them and keeping them
    "no content sums": [("    local sum = sums and sub(sums, 16 * i - 15, 16 * i)\n"
                         "      or sub(redis.sha1hex(argv[o] .. argv[o + 1]), 1, 16)\n",
                         "    local sum = ''\n"),
                        ("hset_pairs(job_sums, fresh_sums)\n", "")],
    "no lane appends": [("    redis.call('RPUSH', base .. ':lane:' .. ctx.inst .. ':' .. lane, unpack(t.recs))\n"
                         "    redis.call('RPUSH', base .. ':lanetok:' .. ctx.inst .. ':' .. lane, unpack(t.toks))\n",
                         "")],
    "no lane choice": [("    local lane, rep = choose_lane(cfg, ctx, tok)\n", "    local lane, rep = '0', tok\n")],
    "record decoded twice": [("  local ok, d = pcall(cjson_decode, rec)\n",
                              "  local ok, d = pcall(cjson_decode, rec)\n  ok, d = pcall(cjson_decode, rec)\n")],
}
ADDED = {"record decoded twice"}  # copies that do a part twice instead of skipping it


def copies() -> tuple[dict[str, str], list[str]]:
    src = source("submit")
    out, skipped = {"as is": src}, []
    for name, pairs in CUTS.items():
        new = src
        for anchor, repl in pairs:
            if new.count(anchor) != 1:
                skipped.append(name)
                break
            new = new.replace(anchor, repl)
        else:
            out[name] = new
    return out, skipped


def profile(r: redis.Redis, n: int, reps: int, chunk: int, shapes: int = 20, log=print,
            extra: dict[str, str] | None = None) -> dict[str, object]:
    """Each copy submits the same items to its own model on one server, call by call in turn, so
    load on the machine hits them alike; server time per call comes from SLOWLOG (threshold 2 ms),
    grouped by script sha, per item. ``extra`` adds named copies (full script sources)."""
    # Conductor.submit sends a model's items grouped by shape: so do the copies.
    items = grouped_by_shape(make_items(n, shapes=shapes, seed=1, tag="s"))
    srcs, skipped = copies()
    srcs.update(extra or {})
    names = list(srcs)
    scripts = {k: r.register_script(v) for k, v in srcs.items()}
    calls = -(-n // chunk)
    cap = 4 * calls * len(names) + 1000  # room for an inner command slower than the threshold now and then
    old = r.config_get("slowlog-*")
    per_call: dict[str, list[float]] = {k: [] for k in names}
    try:
        for _ in range(reps):
            r.flushall()
            keys = {}
            for i, name in enumerate(names):
                mk = Conductor(r).ensure_model(f"prof{i}")
                keys[name] = [mk.base, mk.cfg, mk.state]
            # Commands a script runs are logged too (a few us each: under the threshold); a whole call
            # takes 0.5 ms and more. The threshold was 2 ms: on a fast machine a 400-item call of a cut
            # copy took less, no call was logged and its figure came out empty.
            r.config_set("slowlog-log-slower-than", 200)
            r.config_set("slowlog-max-len", cap)
            r.slowlog_reset()
            for c, s in enumerate(range(0, n, chunk)):
                args = submit_args("j", items[s:s + chunk])
                for name in names[c % len(names):] + names[:c % len(names)]:
                    scripts[name](keys=keys[name], args=args)
            by_sha = {sc.sha: k for k, sc in scripts.items()}
            for entry in r.slowlog_get(cap):
                cmd = entry["command"]
                cmd = cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)
                parts = cmd.split(" ", 2)
                if parts[0].upper() == "EVALSHA" and len(parts) > 1 and parts[1] in by_sha:
                    per_call[by_sha[parts[1]]].append(float(entry["duration"]) / chunk)
    finally:
        r.config_set("slowlog-log-slower-than", old.get("slowlog-log-slower-than", 10000))
        r.config_set("slowlog-max-len", old.get("slowlog-max-len", 128))
    res = {k: median(v) for k, v in per_call.items()}
    for k, v in res.items():
        log(f"  submit copy {k:18s} {v:6.1f} us server per item")
    return {"per_item": res, "skipped": skipped, "chunk": chunk, "shapes": shapes}


def as_markdown(res: dict[str, object]) -> str:
    per = res["per_item"]
    base = per["as is"]  # type: ignore[index]
    lines = ["| submit.lua copy | server us per item (SLOWLOG p50) | the part costs |", "|---|---|---|"]
    for k, v in per.items():  # type: ignore[union-attr]
        cost = "" if k == "as is" else f"{(v - base if k in ADDED else base - v):.1f} us/item"
        lines.append(f"| {k} | {v:.1f} | {cost} |")
    if res["skipped"]:
        lines += ["", f"Skipped (anchor gone from submit.lua): {', '.join(res['skipped'])}."]  # type: ignore[arg-type]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=30_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1000)
    a = p.parse_args(argv)
    with EmbeddedRedis() as srv:
        print(as_markdown(profile(connect(srv.url), a.items, a.reps, a.chunk)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
