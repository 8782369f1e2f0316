"""Where claim.lua spends its server time: the phases of one claim.

    .venv/bin/python bench/claim_profile.py [--backlog 30000] [--claims 400]

Runs an instrumented COPY of lua/claim.lua (the file is never changed) against a private
redis-server: TIME marks between the phases of one claim (argument checks, config, the
model's state, the reclaimed queue, the gate, the shape instance, the aging and hygiene sweep
(most claims skip it), the lane pick, reading the lane's token list and packing, SORT ... STORE
of the items into the batch list, the two LTRIMs, lane and instance counters, XADD of the batch
entry, the delivering XCLAIM, the model's counters). Each TIME mark costs 2-3 us itself, so the
phases add up to more than the script's time as it ships; the uninstrumented script is timed in
the same run (SLOWLOG) for reference.

Schema 1 (lanes as streams of fields, the batch as a msgpack blob built in Lua) was profiled
the same way before this layout replaced it: bench/RESULTS.md keeps those figures.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from bench.common import median  # noqa: E402
from bench.workload import make_items  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402
from conductor.redis_contract.scripts import source  # noqa: E402

MODEL = "bench"

MARK = ("local TT = {}\nlocal function mark(n) local t = redis.call('TIME'); TT[#TT + 1] = n; "
        "TT[#TT + 1] = tonumber(t[1]) * 1000000 + tonumber(t[2]) end\nmark('start')\n")

# (anchor, replacement) pairs; each anchor must occur exactly once in claim.lua.
INSTRUMENT = [
    ("local cfg = load_cfg(cfg_key, CLAIM_CFG)\n",
     "mark('argument checks')\nlocal cfg = load_cfg(cfg_key, CLAIM_CFG)\nmark('load_cfg')\n"),
    ("local warming_now = st[11] or ''\n", "local warming_now = st[11] or ''\nmark('model state read')\n"),
    ("local head = num(st[6]) > 0 and redis.call('LINDEX', reclaimed_key, 0)\n",
     "local head = num(st[6]) > 0 and redis.call('LINDEX', reclaimed_key, 0)\nmark('reclaimed queue')\n"),
    ("local cleanup = st[5] == '1'\n", "mark('gate')\nlocal cleanup = st[5] == '1'\n"),
    ("  local ik = inst_key(active)\n  local ist = info[1]\n",
     "  mark('instance read')\n  local ik = inst_key(active)\n  local ist = info[1]\n"),
    ("  -- Full batch: round-robin", "  mark('aging and hygiene sweep')\n  -- Full batch: round-robin"),
    ("  local meta = redis.call('HMGET', mk, 'rep', 'last_ms', 'items', 'tokens')\n",
     "  mark('lane pick')\n  local meta = redis.call('HMGET', mk, 'rep', 'last_ms', 'items', 'tokens')\n"),
    ("  if k == 0 then return nil end\n", "  mark('token list read, packing')\n  if k == 0 then return nil end\n"),
    ("  redis.call('LTRIM', lk, k, -1)\n", "  mark('SORT BY nosort STORE')\n  redis.call('LTRIM', lk, k, -1)\n"),
    ("  -- Counters are read once and written once per hash (see deliver).\n",
     "  mark('LTRIM lane and tokens')\n  -- Counters are read once and written once per hash (see deliver).\n"),
    ("  local sig, ep = string.match(inst",
     "  mark('lane and instance counters')\n  local sig, ep = string.match(inst"),
    ("  redis.call('XCLAIM', batches_key, 'workers', consumer, 0, bid, 'FORCE', 'JUSTID')\n",
     "  mark('XADD batch entry')\n"
     "  redis.call('XCLAIM', batches_key, 'workers', consumer, 0, bid, 'FORCE', 'JUSTID')\n"
     "  mark('XCLAIM deliver')\n"),
    ("  return {1, bid, sig, ep, lane, pad8(maxlen), now, flags, dv, n, warming_now}",
     "  mark('model counters')\n  return {1, bid, sig, ep, lane, pad8(maxlen), now, flags, dv, n, warming_now, TT}"),
]


def instrumented(src: str) -> str | None:
    for anchor, new in INSTRUMENT:
        if src.count(anchor) != 1:
            return None
        src = src.replace(anchor, new)
    first = src.index("local base, cfg_key")
    return src[:first] + MARK + src[first:]


def backlog(r: redis.Redis, n: int) -> None:
    """``n`` items of about 300 bytes in one shape, dispatchable at once."""
    c = Conductor(r)
    c.set_config(MODEL, {"release_batches": 0, "activate_batches": 0, "quiet_ms": 600_000,
                         "budget_tokens": 64 * 512, "budget_items": 64})
    items = make_items(n, shapes=1, seed=2, tag="p", mu=4.6, sigma=0.25)
    for s in range(0, n, 20_000):
        c.submit(items[s:s + 20_000], "profile")


def _is_evalsha(cmd: bytes | str) -> bool:
    if isinstance(cmd, bytes):
        cmd = cmd.decode(errors="replace")
    return cmd.upper().startswith("EVALSHA")


def profile(r: redis.Redis, n: int, claims: int, log=print) -> dict[str, object]:
    """The instrumented copy and claim.lua as is claim from one backlog, call by call in turn;
    phases are medians of the marks, the script's own time is SLOWLOG's median."""
    src = source("claim")
    body = instrumented(src)
    if body is None:
        raise RuntimeError("claim.lua no longer has the lines the instrumented copy marks: update INSTRUMENT")
    r.flushall()
    r.script_flush()
    backlog(r, max(n, 3 * (claims + 10) * 64))  # two claims per turn, and lanes left ready to the end
    copy_sha, as_is_sha = r.script_load(body), r.script_load(src)
    mk = K.ModelKeys(MODEL)
    keys = [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed]
    args = ["p", 64, 64 * 512, 100_000]
    old = r.config_get("slowlog-*")
    cap = 60 * claims + 100
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", cap)
    phases: dict[str, list[float]] = {}
    as_is: list[float] = []
    for i in range(claims + 10):
        r.slowlog_reset()
        reply = r.evalsha(as_is_sha, len(keys), *keys, *args, secrets.token_hex(8))
        took = [float(e["duration"]) for e in r.slowlog_get(10) if _is_evalsha(e["command"])]
        reply_i = r.evalsha(copy_sha, len(keys), *keys, *args, secrets.token_hex(8))
        if reply[0] != 1 or reply_i[0] != 1:
            raise RuntimeError(f"claim answered {reply!r} / {reply_i!r}")
        if i < 10:
            continue  # warm-up
        as_is += took
        tt = reply_i[-1]
        for j in range(2, len(tt), 2):
            phases.setdefault(tt[j].decode(), []).append(float(tt[j + 1] - tt[j - 1]))
    r.config_set("slowlog-log-slower-than", old.get("slowlog-log-slower-than", 10000))
    r.config_set("slowlog-max-len", old.get("slowlog-max-len", 128))
    out = {"phases": {k: median(v) for k, v in phases.items()}, "as_is_us": median(as_is), "claims": claims}
    for k, v in out["phases"].items():  # type: ignore[union-attr]
        log(f"  {k:32s} {v:6.0f} us")
    log(f"  claim.lua as is, server time per call (SLOWLOG p50): {out['as_is_us']:.0f} us")
    return out


def as_markdown(res: dict[str, object]) -> str:
    phases: dict[str, float] = res["phases"]  # type: ignore[assignment]
    total = sum(phases.values())
    lines = ["| phase of one claim (instrumented copy) | median us | share |", "|---|---|---|"]
    for k, v in phases.items():
        lines.append(f"| {k} | {v:.0f} | {v / total:.0%} |")
    lines += ["", f"Sum of the phases {total:.0f} us (each mark adds 2-3 us); claim.lua as is, same run: "
              f"**{res['as_is_us']:.0f} us** server time per call (SLOWLOG median of {res['claims']} calls)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backlog", type=int, default=30_000)
    p.add_argument("--claims", type=int, default=400)
    args = p.parse_args(argv)
    with EmbeddedRedis() as srv:
        res = profile(connect(srv.url), args.backlog, args.claims)
    print(as_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
