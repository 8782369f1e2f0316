"""Where claim.lua spends its server time: the functions of one claim.

    .venv/bin/python bench/profiles/claim_profile.py [--backlog 30000] [--claims 400]

Runs an instrumented COPY of claim.lua as it is loaded (its includes inlined; the files are never
changed) against a private redis-server: every function the includes define, but the small
helpers called per item or per field (SMALL), is wrapped so that it adds its time (TIME before
and after) and its calls to a table, and the script's own top-level code runs as one function
whose reply carries that table. Nothing is cut at text anchors inside a function: the copy
follows claim.lua and its includes as they change (a new function is timed, a removed one
drops out of the table). A wrapped function's time includes the functions it calls; each TIME
costs 2-3 us itself, so the copy's figures add up to more than the script as it ships, which is
timed in the same run (SLOWLOG) for reference.

Schema 1 (lanes as streams of fields, the batch as a msgpack blob built in Lua) was profiled
the same way before this layout replaced it: bench/RESULTS.md keeps those figures.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402

from bench.common.report import median  # noqa: E402
from bench.common.workload import make_items  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402
from conductor.redis_contract.scripts import source  # noqa: E402

MODEL = "bench"
WHOLE = "claim.lua, whole (instrumented)"

# Helpers called per item, per lane field or per argument: timing them would time the TIME calls.
SMALL = {"num", "pad8", "int_in", "now_ms", "hmget_named", "json_str", "u64_ok", "stream_id_ok", "id_cmp",
         "lane_weight", "lane_is_ready", "inst_key", "alive", "fits", "item_record", "index_version", "push_all"}

_PROFILER = r"""
local PROF_US, PROF_N = {}, {}
local function prof_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function prof_pack(...) return {n = select('#', ...), ...} end
local function timed(name, f)
  return function(...)
    local t0 = prof_now()
    local r = prof_pack(f(...))
    PROF_US[name] = (PROF_US[name] or 0) + prof_now() - t0
    PROF_N[name] = (PROF_N[name] or 0) + 1
    return unpack(r, 1, r.n)
  end
end
"""


def main_line(claim_lua: str) -> str:
    """The first line of claim.lua's own code after its last include (code between includes, such as the
    idle answer given before the rest is defined, stays outside the timed main)."""
    lines = claim_lua.splitlines()
    last = max((i for i, line in enumerate(lines) if line.startswith("--@include")), default=-1)
    for line in lines[last + 1:]:
        if line.strip() and not line.startswith(("#!", "--")):
            return line
    raise RuntimeError("claim.lua has no code")


def timed_functions(src: str) -> list[str]:
    """The functions the copy times: every local function of the includes but the small helpers."""
    return [f for f in re.findall(r"^local function (\w+)", src, re.M) if f not in SMALL]


def instrumented(src: str, first: str) -> str:
    """``src`` (claim.lua with its includes inlined) with its functions timed and its own code
    run as one function whose batch reply gets the profile appended: [names, us, calls]."""
    at = src.index(first + "\n")
    wraps = "".join(f"{f} = timed('{f}', {f})\n" for f in timed_functions(src[:at]))
    main = src[at:]
    return (src[:at] + _PROFILER + wraps
            + "local function prof_main()\nlocal prof_t0 = prof_now()\nlocal r = (function()\n" + main
            + "\nend)()\nPROF_US['" + WHOLE + "'] = prof_now() - prof_t0\nreturn r\nend\n"
            + "local reply = prof_main()\n"
            + "if type(reply) == 'table' and reply[1] == 1 then\n"
            + "  local names, us, calls = {}, {}, {}\n"
            + "  for k, v in pairs(PROF_US) do names[#names + 1] = k; us[#us + 1] = v; calls[#calls + 1] = "
            + "PROF_N[k] or 1 end\n"
            + "  reply[#reply + 1] = {names, us, calls}\n"
            + "end\nreturn reply\n")


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
    body = instrumented(src, main_line((Path(__file__).resolve().parents[2] / "lua" / "claim.lua").read_text()))
    r.flushall()
    r.script_flush()
    backlog(r, max(n, 3 * (claims + 10) * 64))  # two claims per turn, and lanes left ready to the end
    copy_sha, as_is_sha = r.script_load(body), r.script_load(src)
    mk = K.ModelKeys(MODEL)
    keys = [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed]
    args = ["p", 64, 64 * 512]
    old = r.config_get("slowlog-*")
    cap = 60 * claims + 100
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", cap)
    phases: dict[str, list[float]] = {}
    calls: dict[str, list[float]] = {}
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
        names, us, n = reply_i[-1]
        for name, t, k in zip(names, us, n, strict=True):
            phases.setdefault(name.decode(), []).append(float(t))
            calls.setdefault(name.decode(), []).append(float(k))
    r.config_set("slowlog-log-slower-than", old.get("slowlog-log-slower-than", 10000))
    r.config_set("slowlog-max-len", old.get("slowlog-max-len", 128))
    ordered = sorted(phases, key=lambda k: (k != WHOLE, -median(phases[k])))
    out = {"phases": {k: median(phases[k]) for k in ordered}, "calls": {k: median(calls.get(k, [1])) for k in ordered},
           "as_is_us": median(as_is), "claims": claims}
    for k, v in out["phases"].items():  # type: ignore[union-attr]
        log(f"  {k:32s} {v:6.0f} us")
    log(f"  claim.lua as is, server time per call (SLOWLOG p50): {out['as_is_us']:.0f} us")
    return out


def as_markdown(res: dict[str, object]) -> str:
    phases: dict[str, float] = res["phases"]  # type: ignore[assignment]
    calls: dict[str, float] = res["calls"]  # type: ignore[assignment]
    whole = phases.get(WHOLE) or 1.0
    lines = ["| function of one claim (instrumented copy; time includes what it calls) | calls | median us "
             "| share of the whole |", "|---|---|---|---|"]
    for k, v in phases.items():
        lines.append(f"| {k} | {calls.get(k, 1):.0f} | {v:.0f} | {v / whole:.0%} |")
    lines += ["", f"Each timed call adds 2-3 us (two TIME calls); claim.lua as is, same run: "
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
