"""claim.lua's, complete.lua's or submit.lua's own Lua work by Lua function (issue 36): the w16 job's calls
of one script replayed in Lua 5.1 (lupa), outside Redis, with every ``redis.call`` answered by a live
redis-server, and the VM's work counted per function.

    .venv/bin/python bench/profiles/claim_lua_profile.py --workers 16 --items 24000 --workload w16 [--top 30]
    .venv/bin/python bench/profiles/claim_lua_profile.py --script complete ...   # or --script submit
    .venv/bin/python bench/profiles/claim_lua_profile.py --script submit --callgrind ...

Needs ``pip install lupa`` (``lupa.lua51``: the Lua version Redis 7 embeds); not a dependency of the project.

How: the same job as bench/profiles/script_instructions.py (its WORKLOADS, frozen clock and drive) on a plain
redis-server; each call of ``--script`` runs the expanded script (conductor/redis_contract/scripts.py) in a
lupa Lua 5.1 state instead of EVALSHA: a worker's claim, then the LRANGE of its batch list on the server, as
the client's round trip does; a worker's complete through Call.run (the Script object swapped); the
producer's submit.lua chunks one at a time (the client streams them two in flight: same chunks, same order;
the seal is not replayed). ``redis.call``/``pcall`` go to the server one command at a time (numbers sent as Redis sends
them, '%.17g'; replies made Lua values as Redis makes them: integers numbers, nil false, arrays tables,
errors raised or ``{err=}``), ``redis.acl_check_cmd`` answers yes (the default user), ``cjson.encode`` and
``cmsgpack`` are Python's. The run is single-threaded, so a call replayed this way writes what EVALSHA
would have written, and the job goes on as it does under the harness (same batches, same makespan).

What is counted, per Lua function (named by its ``local function NAME`` line in the expanded script;
``main`` is the chunk: defining the includes' functions and the script's own body): VM instructions
(``debug.sethook`` count hook at every instruction: exact; self and inclusive, inclusive through a shadow
stack kept by the call/return hooks, tail returns popped), calls, C functions called from it by name
(``string.format``, ``tonumber``, ``unpack``...) and ``redis.call``s made from it. How good: VM instructions
are the interpreter's dispatch count, not x86 instructions: a GETTABLE with a string key, a CONCAT of five
strings or a NEWTABLE cost many times a MOVE or a JMP, and a C function's own work (a pattern match, a
format) is not in the count; the C calls and commands listed beside each function give the rest. Redis's
side of a command (its ACL check, argument and reply conversion, about 6.9k x86 instructions, and its
work) is attributed to the function that called it by the commands column only; the number arguments
column counts the Lua numbers passed to commands (each a '%.17g' format in Redis).

``--callgrind``: the other half, by C function, for the calls of ``--script``:
bench/profiles/script_instructions.py's run (redis-server under callgrind, same job, the real EVALSHAs) with
each call's profile kept (submit: its chunks and the seal), then summed: x86 instructions a call by C function
(self), and the inclusive cost of the calls into TARGETS (strtod: a string made a number, by tonumber twice
or by arithmetic once; snprintf: Redis formatting a Lua number argument; sprintf: Lua's own number
formatting and string.format). This redis-server's Lua is static and
stripped, so its own functions show as addresses (on the 7.0.15 build measured: the largest, about 12 %
self, is the VM's loop, luaV_execute).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec  # noqa: E402
import redis  # noqa: E402

from bench.common.workload import WorkloadSpec, generate  # noqa: E402
from bench.packing import suite  # noqa: E402
from bench.profiles.script_instructions import WORKLOADS, freeze_clock  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.client.submit_stream import SUBMIT_CHUNK, count_submit_reply  # noqa: E402
from conductor.embedded import child_tie, free_port  # noqa: E402
from conductor.redis_contract import script_calls as calls  # noqa: E402
from conductor.redis_contract import scripts as S  # noqa: E402
from conductor.workers.worker import Worker, WorkerOptions  # noqa: E402

# the scripts ``--script`` profiles: those of an item's way through (issue 36's cost an item)
SCRIPTS = ("claim", "complete", "submit")
# The Lua side: the redis table, the hooks and the counters. PY is the Python bridge (rcall, json, msgpack).
PRELUDE = r"""
local PY = ...
local PROF = {self = {}, incl = {}, calls = {}, ccalls = {}, cmds = {}, edges = {}, total = 0}
local info = debug.getinfo
local stack, depth = {}, 0
-- the replay's own functions: their work is Redis's C side in the real thing, so it is not counted
local GLUE = {}
local function bump(t, k, n) t[k] = (t[k] or 0) + n end
-- no tail calls in the hook or the glue: Lua 5.1 counts an elided frame as a stack level
local function hook(ev)
  if ev == 'count' then
    local fi = info(2, 'f')
    if fi and not GLUE[fi.func] then
      PROF.total = PROF.total + 1
      bump(PROF.self, fi.func, 1)
    end
    return
  end
  if ev == 'call' then
    local fi = info(2, 'fS')
    if fi.what == 'C' then
      local caller = info(3, 'fS')
      if caller and caller.what ~= 'C' and not GLUE[caller.func] then
        local nm = info(2, 'n')
        local t = PROF.ccalls[caller.func]
        if not t then t = {}; PROF.ccalls[caller.func] = t end
        bump(t, (nm and nm.name) or '?', 1)
      end
    elseif not GLUE[fi.func] then
      bump(PROF.calls, fi.func, 1)
      local caller = info(3, 'f')
      if caller then
        local t = PROF.edges[fi.func]
        if not t then t = {}; PROF.edges[fi.func] = t end
        bump(t, caller.func, 1)
      end
    end
    depth = depth + 1
    stack[depth] = {fi.func, PROF.total}
    return
  end
  -- 'return' or 'tail return': one frame each
  local top = stack[depth]
  if top then
    stack[depth] = nil
    depth = depth - 1
    -- a recursive function's span counted once, at its outermost frame
    local again = false
    for i = 1, depth do if stack[i][1] == top[1] then again = true; break end end
    if not again then bump(PROF.incl, top[1], PROF.total - top[2]) end
  end
end

local function argstr(v)
  if type(v) == 'number' then return string.format('%.17g', v) end
  return v
end
local function send(raise, ...)
  local n = select('#', ...)
  local args = {...}
  local nums = 0
  for i = 1, n do
    if type(args[i]) == 'number' then nums = nums + 1 end
    args[i] = argstr(args[i])
  end
  -- level 1 send, 2 redis.call's closure, 3 the script's function that called it
  local fi = info(3, 'f')
  if fi then
    local t = PROF.cmds[fi.func]
    if not t then t = {}; PROF.cmds[fi.func] = t end
    local name = string.upper(args[1])
    bump(t, name, 1)
    -- Redis formats a Lua number argument with '%.17g' (about 2.3k x86 instructions)
    if nums > 0 then bump(t, name .. '#num', nums) end
  end
  local ok, v = PY.rcall(args, n)
  if not ok then
    if raise then error(v, 0) end
    return {err = v}
  end
  return v
end
local function rcall(...) local r = send(true, ...); return r end
local function rpcall(...) local r = send(false, ...); return r end
local function err_reply(m) return {err = m} end
local function ok_reply(m) return {ok = m} end
local function acl() return true end
local function json(v) local r = PY.json(v); return r end
local function json_decode(v) local r = PY.json_decode(v); return r end
local function sha1hex(v) local r = PY.sha1hex(v); return r end
local function mp_pack(v) local r = PY.mp_pack(v); return r end
local function mp_unpack(v) local r = PY.mp_unpack(v); return r end
for _, f in ipairs({bump, send, argstr, rcall, rpcall, err_reply, ok_reply, acl, json, json_decode, sha1hex,
                    mp_pack, mp_unpack}) do
  GLUE[f] = true
end
redis = {call = rcall, pcall = rpcall, error_reply = err_reply, status_reply = ok_reply, acl_check_cmd = acl,
         sha1hex = sha1hex}
-- cjson.null: a value of its own (Redis's is a light userdata), which the decode's nulls are
cjson = {encode = json, decode = json_decode, null = PY.null}
cmsgpack = {pack = mp_pack, unpack = mp_unpack}

local function run(src, name, keys, argv)
  local f = assert(loadstring(src, '=' .. name))
  KEYS, ARGV = keys, argv
  stack, depth = {}, 0
  debug.sethook(hook, 'cr', 1)
  local ok, r = pcall(f)
  debug.sethook()
  stack, depth = {}, 0
  if not ok then return {err = r} end
  return r
end
local function name_line(f) return info(f, 'S').linedefined end
return run, PROF, name_line
"""


class Replay:
    """One script (claim.lua, complete.lua or submit.lua) run in lupa's Lua 5.1 against a live server
    (module docstring)."""

    def __init__(self, url: str, src: str, script: str = "claim") -> None:
        from lupa import lua51  # type: ignore[import-untyped]  # optional, see the docstring

        self.lupa = lua51
        self.lua = lua51.LuaRuntime(encoding=None, unpack_returned_tuples=True)
        # one raw RESP2 connection: replies as the parser gives them, no redis-py callbacks
        self.conn = redis.Redis.from_url(url, protocol=2).connection_pool.get_connection()
        self.src = src.encode() if isinstance(src, str) else src
        if self.src.startswith(b"#!"):
            self.src = b"--" + self.src  # the shebang line (flags) is Redis's, not Lua's
        self.null = self.lua.table()
        bridge = self.lua.table_from({b"rcall": self._rcall, b"json": self._json, b"json_decode": self._json_decode,
                                      b"sha1hex": self._sha1hex, b"null": self.null,
                                      b"mp_pack": self._mp_pack, b"mp_unpack": self._mp_unpack})
        self.run, self.prof, self.name_line = self.lua.execute(PRELUDE, bridge)
        self.lines = self._function_lines(self.src.decode())
        self.script = script
        self.calls = 0

    @staticmethod
    def _function_lines(src: str) -> dict[int, str]:
        out = {}
        for i, line in enumerate(src.split("\n"), 1):
            m = re.match(r"\s*(?:local\s+)?function\s+([\w.:]+)", line) or \
                re.search(r"(?:local\s+)?([\w.]+)\s*=\s*function\b", line)
            if m:
                out[i] = m.group(1)
        return out

    def _to_lua(self, v: Any) -> Any:
        if v is None:
            return False
        if isinstance(v, list):
            return self.lua.table_from([self._to_lua(x) for x in v])
        return v

    def _rcall(self, args: Any, n: int) -> tuple[bool, Any]:
        argv = [args[i] for i in range(1, n + 1)]
        try:
            self.conn.send_command(*argv)
            return True, self._to_lua(self.conn.read_response())
        except redis.ResponseError as e:
            return False, str(e).encode()

    def _json(self, v: Any) -> bytes:
        return msgspec.json.encode(v.decode() if isinstance(v, bytes) else v)

    def _json_decode(self, s: bytes) -> Any:
        """cjson.decode: a malformed text raises (in Lua, as cjson's error does)."""
        return self._to_lua_deep(msgspec.json.decode(s))

    @staticmethod
    def _sha1hex(s: bytes) -> bytes:
        return hashlib.sha1(s).hexdigest().encode()

    def _plain(self, v: Any) -> Any:
        if self.lupa.lua_type(v) == "table":
            keys = list(v.keys())
            if keys == list(range(1, len(keys) + 1)):
                return [self._plain(v[k]) for k in keys]
            return {self._plain(k): self._plain(v[k]) for k in keys}
        return v

    def _mp_pack(self, v: Any) -> bytes:
        return msgspec.msgpack.encode(self._plain(v))

    def _mp_unpack(self, s: bytes) -> Any:
        return self._to_lua_deep(msgspec.msgpack.decode(s))

    def _to_lua_deep(self, v: Any) -> Any:
        if isinstance(v, dict):
            return self.lua.table_from({self._to_lua_deep(k): self._to_lua_deep(x) for k, x in v.items()})
        if isinstance(v, list):
            return self.lua.table_from([self._to_lua_deep(x) for x in v])
        if isinstance(v, str):
            return v.encode()
        if v is None:
            return self.null
        return v

    def _from_lua(self, v: Any) -> Any:
        """A script's reply as redis-py (no callbacks) gives it."""
        if self.lupa.lua_type(v) == "table":
            if v[b"err"] is not None:
                return redis.ResponseError(bytes(v[b"err"]).decode())
            if v[b"ok"] is not None:
                return v[b"ok"]
            out = []
            i = 1
            while v[i] is not None:
                out.append(self._from_lua(v[i]))
                i += 1
            return out
        if v is None or v is False:
            return None
        if v is True:
            return 1
        if isinstance(v, float):
            return int(v)
        return v

    def call(self, keys: list[Any], argv: list[Any]) -> Any:
        """One call of the script, its reply as redis-py gives an EVALSHA's (an error reply returned)."""
        self.calls += 1
        enc = [k if isinstance(k, bytes) else str(k).encode() for k in keys]
        arg = [a if isinstance(a, bytes) else str(a).encode() for a in argv]
        reply = self.run(self.src, self.script.encode(), self.lua.table_from(enc), self.lua.table_from(arg))
        return self._from_lua(reply)

    def __call__(self, keys: list[Any], args: list[Any], client: Any = None) -> Any:
        """As a registered script is called (scripts.Scripts): what Call.run sends its script through."""
        reply = self.call(keys, args)
        if isinstance(reply, redis.ResponseError):
            raise reply
        return reply

    def name(self, f: Any) -> str:
        line = int(self.name_line(f))
        if line == 0:
            return "main"
        return self.lines.get(line, f"anon@{line}")

    def _rows(self) -> dict[str, dict[str, Any]]:
        """The counters by function name: self, incl, calls, c (C calls by name), cmd (commands, and their
        number arguments as 'CMD#num'), by (callers)."""
        rows: dict[str, dict[str, Any]] = {}

        def row(f: Any) -> dict[str, Any]:
            return rows.setdefault(self.name(f), {"self": 0, "incl": 0, "calls": 0, "c": {}, "cmd": {}, "by": {}})

        for part, col in ((b"self", "self"), (b"incl", "incl"), (b"calls", "calls")):
            for f, n in self.prof[part].items():
                row(f)[col] += int(n)
        for part, col in ((b"ccalls", "c"), (b"cmds", "cmd"), (b"edges", "by")):
            for f, t in self.prof[part].items():
                d = row(f)[col]
                for k, n in t.items():
                    if col == "by":
                        k = self.name(k)
                    elif isinstance(k, bytes):
                        k = k.decode()
                    d[k] = d.get(k, 0) + int(n)
        rows["main"]["incl"] = int(self.prof[b"total"])
        return rows

    @staticmethod
    def _line(name: str, v: dict[str, Any], total: int, c: int) -> str:
        def top(d: dict[str, int], keep: Any, n: int = 6) -> list[tuple[str, int]]:
            return [(k, x) for k, x in sorted(d.items(), key=lambda kv: -kv[1]) if keep(k)][:n]

        cc = ", ".join(f"{k} {n / c:.1f}" for k, n in top(v["c"], lambda k: k not in ("call", "pcall")))
        cm = ", ".join(f"{k} {n / c:.1f}" for k, n in top(v["cmd"], lambda k: not k.endswith("#num"), 8))
        nums = ", ".join(f"{k[:-4]} {n / c:.1f}" for k, n in top(v["cmd"], lambda k: k.endswith("#num"), 8))
        by = ", ".join(f"{k} {n / c:.1f}" for k, n in top(v["by"], lambda k: True, 4)) if v["calls"] >= 3 * c else ""
        return (f"  {100 * v['self'] / total:6.1f} {v['self'] / c:7.0f} {100 * v['incl'] / total:6.1f} "
                f"{v['calls'] / c:6.1f}  {name}: {cc}" + (f"; [{cm}]" if cm else "")
                + (f"; number arguments: {nums}" if nums else "") + (f"; from {by}" if by else ""))

    def table(self, top: int) -> str:
        """The profile: ``top`` functions by their own VM instructions, a call of the script each."""
        total = max(int(self.prof[b"total"]), 1)
        rows = self._rows()
        c = max(self.calls, 1)
        s = self.script
        out = [f"{self.calls} {s} calls, {total / c:,.0f} VM instructions a call; per {s} call:",
               f"  {'self %':>6s} {'self':>7s} {'incl %':>6s} {'calls':>6s}  function: C calls, [commands]"]
        for name, v in sorted(rows.items(), key=lambda kv: -kv[1]["self"])[:top]:
            out.append(self._line(name, v, total, c))
        ctot: dict[str, int] = {}
        for v in rows.values():
            for k, n in v["c"].items():
                ctot[k] = ctot.get(k, 0) + n
        out.append(f"  C functions a {s} call, all callers: " + ", ".join(
            f"{k} {n / c:.1f}" for k, n in sorted(ctot.items(), key=lambda kv: -kv[1])[:16]))
        return "\n".join(out)


def _replay_submit(producer: Conductor, rep: Replay) -> None:
    """The producer's submit.lua calls made one at a time through ``rep`` (the same chunks, in order,
    which the client otherwise streams two in flight over a connection of its own)."""

    def submit_calls(mk: Any, job: str, its: Any, report: Any, progress: Any = None, idle: Any = None) -> None:
        for start in range(0, len(its), SUBMIT_CHUNK):
            count_submit_reply(producer._confirmed(calls.submit(mk, job, its[start:start + SUBMIT_CHUNK])), report)

    producer.scripts.submit = rep  # type: ignore[assignment]
    producer._submit_calls = submit_calls  # type: ignore[method-assign]


def run(items: int, workers: int, workload: str, top: int, script: str = "claim") -> str:
    """The job with every call of ``script`` replayed in Lua 5.1 (module docstring); its profile."""
    thaw = freeze_clock(int(time.time()))
    d = Path(tempfile.mkdtemp(prefix="claim-lua-"))
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(d)], stdout=subprocess.DEVNULL,
                            preexec_fn=child_tie())
    url = f"redis://127.0.0.1:{port}/0"
    try:
        r = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        rep = Replay(url, S.source(script), script)
        wl = generate(WorkloadSpec(items=items, **WORKLOADS[workload]))
        cfg = suite.SuiteConfig(workers=workers, wake="bell")
        producer = Conductor(connect(url))
        producer.ensure_model(wl.spec.model)
        if script == "submit":
            _replay_submit(producer, rep)
        engines = suite._engines(cfg, wl.spec.model)
        ws = []
        for i, eng in enumerate(engines):
            c = Conductor(connect(url))
            w = Worker(c, eng, WorkerOptions(name=f"cg-w{i}", high_water=cfg.high_water, low_water=cfg.low_water,
                                             heartbeat_ttl_s=3600.0))
            w.register()

            def round_trip(call: Any, mk: Any, consumer: str, token: str, c: Any = c) -> tuple[Any, Any]:
                reply = rep.call(call.keys, call.args)
                return reply, c.r.lrange(mk.batch_items(token), 0, -1)

            if script == "claim":
                c._round_trip = round_trip  # type: ignore[method-assign]
            elif script == "complete":
                c.scripts.complete = rep  # type: ignore[assignment]  # Call.run: calls it as a Script
            ws.append(w)
        producer.submit(wl.items, "cost", seal=True)
        finished = lambda: sum(w.finished for w in ws)  # noqa: E731
        makespan, _ = suite.drive(ws, engines, items, finished, None, 3600.0, wake=cfg.wake)
        for w in ws:
            while w.retry or w.inflight:
                w.turn()
        head = f"{items} items, {workers} workers, workload {workload}; simulated makespan {makespan:.3f} s"
        return head + "\n" + rep.table(top)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(d, ignore_errors=True)
        thaw()


# C functions whose inclusive cost per claim ``--callgrind`` prints (module docstring)
TARGETS = ("scriptCall", "____strtod_l_internal", "__snprintf_chk", "__sprintf_chk", "lua_pushlstring", "lua_settable",
           "realloc", "lpFind")


def callgrind_calls(items: int, workers: int, workload: str, top: int, script: str = "claim") -> str:
    """``script``'s calls' x86 instructions by C function (module docstring, ``--callgrind``)."""
    from bench.profiles import script_instructions as SI

    with tempfile.TemporaryDirectory(prefix=f"cg-{script}-") as d:
        out, keep = Path(d) / "run", Path(d) / "calls"
        out.mkdir()
        keep.mkdir()
        res = SI.measure(items, workers, out, say=lambda _line: None, workload=workload, keep=keep,
                         keep_script=script)
        own: dict[str, int] = {}
        incl: dict[str, list[int]] = {t: [0, 0] for t in TARGETS}
        files = list(keep.iterdir())
        for f in files:
            _sum_profile(f.read_text(), own, incl)
    n = max(len(files), 1)
    total = sum(own.values())
    lines = [SI.report(res), f"{len(files)} {script} calls, {total / n:,.0f} instructions a call, "
             f"{total / items:,.0f} an item of the job; by C function, self:"]
    for name, v in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {v / n:10,.0f} {100 * v / total:5.1f} %  {name}")
    lines.append(f"inclusive, a {script} call: " + "; ".join(
        f"{t} {v[0] / n:,.0f} ({v[1] / n:.1f} calls)" for t, v in incl.items()))
    return "\n".join(lines)


def _sum_profile(text: str, own: dict[str, int], incl: dict[str, list[int]]) -> None:
    """One callgrind profile (name compression, one event: Ir) added in: self cost per function into own,
    the cost and count of calls into each of incl's functions (from another function) into incl."""
    names: dict[str, str] = {}
    fn = cfn = ""
    calls: int | None = None
    for line in text.splitlines():
        if line.startswith(("fn=", "cfn=")):
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
            if m is None:
                continue
            if m.group(2):
                names[m.group(1)] = m.group(2)
            if line.startswith("fn="):
                fn = names.get(m.group(1), m.group(1))
            else:
                cfn = names.get(m.group(1), m.group(1))
        elif line.startswith("calls="):
            calls = int(line[6:].split()[0])
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            if len(parts) < 2:
                continue
            if calls is not None:
                if cfn in incl and cfn != fn:
                    incl[cfn][0] += int(parts[1])
                    incl[cfn][1] += calls
                calls = None
            else:
                own[fn] = own.get(fn, 0) + int(parts[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=4000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w2")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--script", choices=SCRIPTS, default="claim", help="the script profiled")
    p.add_argument("--callgrind", action="store_true", help="the script's calls by C function, under callgrind")
    a = p.parse_args(argv)
    if a.callgrind:
        print(callgrind_calls(a.items, a.workers, a.workload, a.top, a.script))
    else:
        print(run(a.items, a.workers, a.workload, a.top, a.script))
    return 0


if __name__ == "__main__":
    sys.exit(main())
