"""A tool, not a test: proof that a Lua restructure changed no behaviour. Every scenario of
tests/script_harness.py is built once and its script call run, from that same state, with the Lua
of a git revision and with the working tree's; the commands each run issued (MONITOR, timestamps and
stream ids normalised, empty arguments dropped) and the replies must be the same.

    .venv/bin/python -m tests.lua_trace_diff [REV [SCRIPT ...]]     (REV defaults to HEAD)
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import threading
import time
from typing import Any

import redis

from conductor.client import Conductor
from conductor.embedded import EmbeddedRedis
from conductor.redis_contract.scripts import GENERATED, _read, expand
from tests import script_harness as H

_NORM = re.compile(r"\b\d{13}(-\d+)?\b")


def _norm(text: str) -> str:
    return " ".join(_NORM.sub("T", text).split())


def _trace(url: str, admin: redis.Redis, call: H.Call, src: str) -> tuple[str, list[str]]:
    snap = H.snapshot(admin)
    out: list[str] = []
    mon = redis.Redis.from_url(url)
    ready = threading.Event()

    def watch() -> None:
        with mon.monitor() as m:
            ready.set()
            for cmd in m.listen():
                if cmd["command"] == "ECHO lua-trace-diff-end":
                    return
                if cmd.get("client_type") == "lua":
                    out.append(_norm(cmd["command"]))

    t = threading.Thread(target=watch)
    t.start()
    ready.wait()
    time.sleep(0.05)
    reply: Any
    try:
        reply = admin.evalsha(admin.script_load(src), len(call.keys), *call.keys, *call.args)
    except redis.ResponseError as e:
        reply = e
    admin.echo("lua-trace-diff-end")
    t.join(5)
    H.restore(admin, snap)
    return _norm(repr(reply)), out


def main(rev: str = "HEAD", only: list[str] | None = None) -> int:
    def read_rev(f: str) -> str:
        if f == GENERATED:
            return _read(f)
        return subprocess.run(["git", "show", f"{rev}:lua/{f}"], capture_output=True, text=True, check=True).stdout

    srv = EmbeddedRedis(extra=["--enable-debug-command", "yes"]).start()
    admin = redis.Redis.from_url(srv.url)
    diffs = 0
    try:
        for script, scenarios in sorted(H.SCENARIOS.items()):
            if only and script not in only:
                continue
            old, new = expand(f"{script}.lua", read_rev), expand(f"{script}.lua", _read)
            for scenario in scenarios:
                admin.flushall()
                call = scenario(Conductor(admin))  # built once: each side runs from the same state
                sides = [_trace(srv.url, admin, call, src) for src in (old, new)]
                same = sides[0] == sides[1]
                print("ok  " if same else "DIFF", script, scenario.__name__, len(sides[0][1]), "commands")
                if not same:
                    diffs += 1
                    print("  replies:", sides[0][0], "|", sides[1][0])
                    for line in list(difflib.unified_diff(sides[0][1], sides[1][1], lineterm="", n=1))[:30]:
                        print("   ", line[:200])
    finally:
        srv.close()
    print("scenarios that differ:", diffs)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "HEAD", sys.argv[2:]))
