"""Where claim.lua spends its server time, and what two candidate changes would save.

    .venv/bin/python bench/claim_profile.py [--backlog 60000] [--claims 300]

Runs COPIES of lua/claim.lua (the file is never changed) against a private redis-server:

* ``instrumented``: TIME marks between the phases of one claim (config, lane pick, XRANGE of
  the lane head, the packing loop, XDEL, lane counters, msgpack of the batch, XADD of the
  batch, the XREADGROUP that delivers it). TIME itself costs a few microseconds per mark.
* ``xtrim``: XDEL of the taken ids replaced by ``XTRIM lane MINID <last id + 1>``: a batch is
  always the head of its lane, so trimming by id removes exactly those entries.
* ``packed-entry``: lane entries written (by a copy of submit.lua) as tok, mt and the item
  already msgpack-encoded; the claim reads 6 strings per entry instead of 10 and builds the
  batch blob by concatenation instead of cmsgpack.pack (the blob's bytes are the same). It
  claims from its own model's backlog on the same server, in the same turns.
* ``small-entry``: the batch blob kept in a side hash instead of the batches stream entry, so
  the delivering XREADGROUP reads back a small entry (a real change would also need
  complete.lua, reclaim.lua and the client to read the blob from there).

All copies claim from one backlog, call by call in turn; server time per call is SLOWLOG's.
When claim.lua no longer has the lines an experiment rewrites, that experiment is skipped
and says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import redis  # noqa: E402

from bench.common import median  # noqa: E402
from conductor import keys as K  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.scripts import source  # noqa: E402

MODEL = "bench"

MARK = ("local TT = {}\nlocal function mark(n) local t = redis.call('TIME'); TT[#TT + 1] = n; "
        "TT[#TT + 1] = tonumber(t[1]) * 1000000 + tonumber(t[2]) end\nmark('start')\n")

# (anchor, replacement) pairs; each anchor must occur exactly once in claim.lua.
INSTRUMENT = [
    ("local cfg = load_cfg(cfg_key)\n", "local cfg = load_cfg(cfg_key)\nmark('config')\n"),
    ("  local entries = redis.call('XRANGE', lk, '-', '+', 'COUNT', max_items)\n",
     "  mark('pick lane')\n  local entries = redis.call('XRANGE', lk, '-', '+', 'COUNT', max_items)\n"
     "  mark('XRANGE')\n"),
    ("  redis.call('XDEL', lk, unpack(ids))\n", "  mark('packing loop')\n  redis.call('XDEL', lk, unpack(ids))\n"
     "  mark('XDEL')\n"),
    ("  local sig, ep = string.match(inst", "  mark('lane counters')\n  local sig, ep = string.match(inst"),
    ("  local blob = cmsgpack.pack({sig, ep, lane, pad8(maxlen), mt, now, flags, items})\n",
     "  local blob = cmsgpack.pack({sig, ep, lane, pad8(maxlen), mt, now, flags, items})\n  mark('cmsgpack.pack')\n"),
    ("'w', consumer, 'ts', now, 'b', blob)\n", "'w', consumer, 'ts', now, 'b', blob)\n  mark('XADD batch')\n"),
    ("  redis.call('XREADGROUP', 'GROUP', 'workers', consumer, 'COUNT', 1, 'STREAMS', batches_key, '>')\n",
     "  redis.call('XREADGROUP', 'GROUP', 'workers', consumer, 'COUNT', 1, 'STREAMS', batches_key, '>')\n"
     "  mark('XREADGROUP deliver')\n"),
]

XTRIM = [("  redis.call('XDEL', lk, unpack(ids))\n",
          "  local ms, seq = string.match(ids[#ids], '^(%d+)-(%d+)$')\n"
          "  redis.call('XTRIM', lk, 'MINID', ms .. '-' .. (tonumber(seq) + 1))\n")]

SMALL_ENTRY = [("'w', consumer, 'ts', now, 'b', blob)\n",
                "'w', consumer, 'ts', now)\n"
                "  redis.call('HSET', base .. ':bench_blobs', now .. ':' .. #items, blob)\n")]


# A candidate layout: lane entries carry tok, mt and the item already msgpack-encoded, so the
# claim reads 6 strings per entry instead of 10 and builds the batch blob by concatenation.
PACKED_SUBMIT = [("      'id', id, 'job', job, 'tok', tok, 'mt', mt, 'd', body)\n",
                  "      'tok', tok, 'mt', mt, 'm', cmsgpack.pack({id, job, tok, tonumber(mt), body, 1}))\n")]
PACKED_CLAIM = [
    ("    local tok = tonumber(f[6])\n", "    local tok = tonumber(f[2])\n"),
    ("    local m = tonumber(f[8])\n    items[#items + 1] = {f[2], f[4], tok, m, f[10], 1}\n",
     "    local m = tonumber(f[4])\n    items[#items + 1] = f[6]\n"),
    ("  local blob = cmsgpack.pack({sig, ep, lane, pad8(maxlen), mt, now, flags, items})\n",
     "  local n = #items\n"
     "  local hdr = n < 16 and string.char(0x90 + n) or string.char(0xdc, math.floor(n / 256), n % 256)\n"
     "  local blob = string.char(0x98) .. cmsgpack.pack(sig, ep, lane, pad8(maxlen), mt, now, flags) .. hdr\n"
     "    .. table.concat(items)\n"),
]


def rewrite(src: str, pairs: list[tuple[str, str]]) -> str | None:
    for anchor, new in pairs:
        if src.count(anchor) != 1:
            return None
        src = src.replace(anchor, new)
    return src


def instrumented(src: str) -> str | None:
    body = rewrite(src, INSTRUMENT)
    if body is None:
        return None
    first = body.index("local base, cfg_key")
    body = body[:first] + MARK + body[first:]
    # Every delivery returns through one `return {1, bid, blob, ...}`: append the marks to it.
    marker = "  return {1, bid, blob"
    if body.count(marker) != 1:
        return None
    return body.replace(marker, "  mark('rest')\n  do return {1, bid, blob, TT} end\n" + marker)


def backlog(r: redis.Redis, n: int, model: str = MODEL, submit_src: str | None = None) -> None:
    """``n`` items of about 300 bytes in one shape, dispatchable at once; ``submit_src`` is a
    copy of submit.lua to write them with (default: submit.lua as is)."""
    from bench.submit_claim import make_items
    c = Conductor(r)
    c.set_config(model, {"release_batches": 0, "activate_batches": 0, "quiet_ms": 600_000,
                         "budget_tokens": 64 * 512, "budget_items": 64})
    items = [msgspec.structs.replace(it, model=model)
             for it in make_items(n, shapes=1, seed=2, tag="p", mu=4.6, sigma=0.25)]
    if submit_src is not None:
        c.scripts.submit = r.register_script(submit_src)
    for s in range(0, n, 20_000):
        c.submit(items[s:s + 20_000], "profile")


def profile(r: redis.Redis, n: int, claims: int, log=print) -> dict[str, object]:
    """Every copy claims from the same backlog, call by call in turn (they leave the same state
    behind), so load on the machine hits them alike; server time per call comes from SLOWLOG
    (threshold 300 us, under any claim of 64 items here), grouped by script sha."""
    src = source("claim")
    variants = {"claim.lua as is": src, "instrumented": instrumented(src), "xtrim": rewrite(src, XTRIM),
                "small-entry": rewrite(src, SMALL_ENTRY), "packed-entry": rewrite(src, PACKED_CLAIM)}
    packed_submit = rewrite(source("submit"), PACKED_SUBMIT)
    if packed_submit is None:
        variants["packed-entry"] = None
    out: dict[str, object] = {"skipped": [k for k, v in variants.items() if v is None]}
    scripts = {k: r.register_script(v) for k, v in variants.items() if v is not None}
    r.flushall()
    r.script_flush()
    shared = (claims + 10) * len(scripts) * 64 + 640
    backlog(r, max(n, shared))
    keys_of = {}
    for name in scripts:
        model = "benchp" if name == "packed-entry" else MODEL
        mk = K.ModelKeys(model)
        keys_of[name] = [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed]
    if "packed-entry" in scripts:
        backlog(r, (claims + 10) * 64 + 640, model="benchp", submit_src=packed_submit)
    args = ["p", 64, 64 * 512, 100_000]
    for name, sc in scripts.items():
        for _ in range(10):
            sc(keys=keys_of[name], args=args)
    old = r.config_get("slowlog-*")
    cap = 60 * claims * len(scripts) + 100
    # Commands a script runs are logged too: a threshold under every claim but over most of
    # them, and room for the rest.
    r.config_set("slowlog-log-slower-than", 300)
    r.config_set("slowlog-max-len", cap)
    r.slowlog_reset()
    phases: dict[str, list[float]] = {}
    names = list(scripts)
    for i in range(claims):
        for name in names[i % len(names):] + names[:i % len(names)]:
            reply = scripts[name](keys=keys_of[name], args=args)
            if reply[0] != 1:
                raise RuntimeError(f"claim copy {name} answered {reply!r}")
            if name == "instrumented":
                tt = reply[3]
                for j in range(2, len(tt), 2):
                    phases.setdefault(tt[j].decode(), []).append(float(tt[j + 1] - tt[j - 1]))
    per_sha: dict[str, list[float]] = {}
    for entry in r.slowlog_get(cap):
        cmd = entry["command"]
        cmd = cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)
        parts = cmd.split(" ", 2)
        if parts[0].upper() == "EVALSHA" and len(parts) > 1:
            per_sha.setdefault(parts[1], []).append(float(entry["duration"]))
    r.config_set("slowlog-log-slower-than", old.get("slowlog-log-slower-than", 10000))
    r.config_set("slowlog-max-len", old.get("slowlog-max-len", 128))
    server = {k: median(per_sha.get(sc.sha, [])) for k, sc in scripts.items()}
    out["server"] = server
    out["phases"] = {k: median(v) for k, v in phases.items()}
    for k, v in server.items():
        log(f"  claim copy {k:16s} p50 {v:7.0f} us server per call")
    return out


def as_markdown(res: dict[str, object]) -> str:
    lines = []
    phases = res.get("phases") or {}
    if phases:
        total = sum(phases.values())  # type: ignore[union-attr]
        lines += ["| phase of one claim (instrumented copy) | median us | share |", "|---|---|---|"]
        for k, v in phases.items():  # type: ignore[union-attr]
            lines.append(f"| {k} | {v:.0f} | {v / total:.0%} |")
        lines.append("")
    server = res.get("server") or {}
    if server:
        base = server.get("claim.lua as is", float("nan"))  # type: ignore[union-attr]
        lines += ["| claim.lua copy | server us per call (SLOWLOG p50) | vs as is |", "|---|---|---|"]
        for k, v in server.items():  # type: ignore[union-attr]
            lines.append(f"| {k} | {v:.0f} | {v / base:.2f}x |")
    if res.get("skipped"):
        lines += ["", f"Skipped (claim.lua no longer has the lines they rewrite): {', '.join(res['skipped'])}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backlog", type=int, default=60_000)
    p.add_argument("--claims", type=int, default=300)
    a = p.parse_args(argv)
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        print(as_markdown(profile(r, a.backlog, a.claims)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
