"""The server's instructions per script call (issue 36), exact and load-independent: valgrind's callgrind
counts what redis-server runs inside each EVALSHA, for submit.lua, claim.lua (with a batch, and idle) and
complete.lua, on a fixed job.

    .venv/bin/python bench/profiles/script_instructions.py [--items 4000] [--workers 2] [--out DIR]
    .venv/bin/python bench/profiles/script_instructions.py --copy no-acl     # the ACL pre-check's share
    .venv/bin/python bench/profiles/script_instructions.py --definitions    # defining the includes' functions

How: ``valgrind --tool=callgrind --collect-atstart=no --toggle-collect=evalShaCommand
--dump-after=evalShaCommand redis-server --port P --save '' --appendonly no`` counts only inside
evalShaCommand (the script's lookup, its ACL checks, its body and every command it calls, its reply
written), and writes one profile per EVALSHA; each Conductor call of the run is given the profiles
written while it ran (the run is single-threaded: no heartbeat thread, no maintenance), so a figure
is the sum of its EVALSHAs' ``totals``. The job: bench/broker/redis_cost.py's w2 workload (seed 11,
30 shapes) cut to ``--items``, submitted as one sealed job through Conductor.submit, then served by
``--workers`` real ``Worker`` loops on sim engines under bench/packing/suite.py's drive (the doorbell
wait of an idle worker included).

The scripts' clock is frozen: ``redis.call('TIME')`` reads as a constant in the copies this run
registers (Redis's TIME would make the sweeps, quiet lanes and aging of claim.lua depend on how fast
valgrind runs). Each frozen read saves the TIME call (about 1k instructions) and keeps every call
after the first sweep off the clock-driven paths; before/after comparisons of a change are exact
(same items, same order, same replies), the absolute figures a little under a real run's.
Runs in about half a minute (the server under callgrind is 30-60 times slower).

``--copy NAME`` runs the same job on copies of the scripts with one part taken out (COPIES; the files are
never changed): the difference to the run as is is that part's cost. ``--definitions``: what defining
the includes' functions costs a call (which every EVALSHA does again): claim.lua, complete.lua and
submit.lua cut right after their last top-level function (claim.lua's idle answer taken out, so every
include is defined), against the same scripts cut at their first line, each called a few times with no
keys (median; Redis's Lua GC steps every 50 calls move a call by a few thousand).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402

from bench.common.workload import WorkloadSpec, generate  # noqa: E402
from bench.packing import suite  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import child_tie, free_port  # noqa: E402
from conductor.redis_contract import scripts as S  # noqa: E402
from conductor.workers.worker import Worker, WorkerOptions  # noqa: E402

VALGRIND = shutil.which("valgrind") or "/usr/bin/valgrind"
# bench/broker/redis_cost.py's w2 point (sweep ref-2w), fewer items
# name -> (file, anchor, replacement): copies of the scripts with one part taken out (``--copy``)
COPIES = {
    # lib.lua acl_refused answers 'allowed' without a check: what the ACL pre-checks cost
    "no-acl": ("lib.lua", "local function acl_refused(checks)\n",
               "local function acl_refused(checks)\n  if checks then return nil end\n"),
}
SPEC = {"seed": 11, "shapes": 30, "zipf_s": 1.1, "prefix_min": 200, "prefix_max": 3000, "suffix_sigma": 0.7}
# ``--workload``: w2 (above), or redis_cost.py's w16 point (fleet f16: seed 103, 120 shapes), whose shape
# switches (the fleet's scheduling reads) weigh more than w2's
WORKLOADS: dict[str, dict[str, Any]] = {"w2": SPEC, "w16": {"seed": 103, "shapes": 120}}


def freeze_clock(now_s: int, copy: str | None = None) -> Callable[[], None]:
    """Every script registered from here on reads ``now_s`` for Redis's TIME (module docstring), and
    has COPIES[copy]'s part taken out, until the function returned is called."""
    read = S._read

    def frozen(file: str) -> str:
        text = read(file)
        if copy is not None and file == COPIES[copy][0]:
            _, anchor, repl = COPIES[copy]
            if text.count(anchor) != 1:
                raise ValueError(f"copy {copy}: its anchor is not once in {file}")
            text = text.replace(anchor, repl)
        return text.replace("redis.call('TIME')", f"({{'{now_s}', '0'}})")

    def thaw() -> None:
        S._read = read  # type: ignore[assignment]
        S.source.cache_clear()

    S._read = frozen  # type: ignore[assignment]
    S.source.cache_clear()
    return thaw


class Server:
    """redis-server under callgrind, one profile per EVALSHA in ``out``."""

    def __init__(self, out: Path, per_call: bool = True) -> None:
        """``per_call`` False: one profile of every EVALSHA together (cg.out, written at shutdown), for
        ``--by-function``; take() then answers nothing."""
        self.out = out
        self.port = free_port()
        dump = ["--dump-after=evalShaCommand"] if per_call else []
        self.proc = subprocess.Popen(
            [VALGRIND, "--tool=callgrind", f"--callgrind-out-file={out}/cg.out", "--collect-atstart=no",
             "--toggle-collect=evalShaCommand", *dump,
             "redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=child_tie())
        self.r = redis.Redis(port=self.port)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server under valgrind did not start") from None
                time.sleep(0.2)
        self.seen = set(self._dumps())

    def _dumps(self) -> list[str]:
        return [p.name for p in self.out.iterdir() if p.name.startswith("cg.out.")]

    def take(self, keep: Path | None = None) -> list[int]:
        """The instructions of each EVALSHA profiled since the last take, in order; their profiles
        moved into ``keep`` when given (else removed)."""
        new = sorted((n for n in self._dumps() if n not in self.seen), key=lambda n: int(n.rsplit(".", 1)[1]))
        out = []
        for name in new:
            self.seen.add(name)
            total = None
            for line in (self.out / name).read_text().splitlines():
                if line.startswith(("totals:", "summary:")):
                    total = int(line.split()[1])
            out.append(total or 0)
            if keep is not None:
                (self.out / name).rename(keep / name)
            else:
                (self.out / name).unlink()
        return out

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        try:
            self.r.shutdown(nosave=True)
        except redis.ConnectionError:
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _wrap(w: Worker, srv: Server, log: list[tuple[str, int, int, bool]], keep: Path | None = None,
          keep_script: str = "claim") -> None:
    """Note each claim (idle or with its batch's items; whether the worker's engine was busy) and complete
    (its results) with its instructions; each ``keep_script`` call's profile moved into ``keep`` when given."""
    keep_claims = keep if keep_script == "claim" else None
    keep_completes = keep if keep_script == "complete" else None
    c = w.c
    claim, complete = c.claim, c.complete

    def claimed(contract: Any, consumer: str) -> Any:
        srv.take()
        busy = w.engine.active() > 0
        batch, why = claim(contract, consumer)
        kind = "claim" if batch is not None else f"claim:{why}" + (" (engine busy)" if busy else " (engine empty)")
        log.append((kind, len(batch.items) if batch else 0, sum(srv.take(keep_claims)), busy))
        return batch, why

    def completed(batch: Any, results: Any, **kw: Any) -> Any:
        srv.take()
        out = complete(batch, results, **kw)
        log.append(("complete", len(results), sum(srv.take(keep_completes)), True))
        return out

    c.claim = claimed  # type: ignore[method-assign]
    c.complete = completed  # type: ignore[method-assign]


def measure(items: int, workers: int, out: Path, say: Callable[[str], None] = print,
            copy: str | None = None, wake: str = "bell", workload: str = "w2",
            per_call: bool = True, keep: Path | None = None, keep_script: str = "claim") -> dict[str, Any]:
    """Run the job on a fresh server under callgrind; per call kind, instructions a call and an item.
    ``copy``: on the scripts with COPIES[copy]'s part taken out; ``wake``: the drive's idle wait
    (bench/packing/suite.py SuiteConfig.wake); ``workload``: WORKLOADS' spec; ``per_call`` False: no
    figures per call, one profile of the whole run left in ``out``/cg.out (by_function reads it);
    ``keep``: each call's profile of ``keep_script`` (claim, complete, or submit: its chunks and the seal) kept
    there (bench/profiles/claim_lua_profile.py --callgrind reads them)."""
    thaw = freeze_clock(int(time.time()), copy)
    srv = Server(out, per_call)
    try:
        wl = generate(WorkloadSpec(items=items, **WORKLOADS[workload]))
        cfg = suite.SuiteConfig(workers=workers, wake=wake)
        producer = Conductor(connect(srv.url()))
        producer.ensure_model(wl.spec.model)
        engines = suite._engines(cfg, wl.spec.model)
        log: list[tuple[str, int, int, bool]] = []
        ws = []
        for i, eng in enumerate(engines):
            c = Conductor(connect(srv.url()))
            w = Worker(c, eng, WorkerOptions(name=f"cg-w{i}", high_water=cfg.high_water, low_water=cfg.low_water,
                                             heartbeat_ttl_s=3600.0))
            w.register()
            _wrap(w, srv, log, keep, keep_script)
            ws.append(w)
        srv.take()
        producer.submit(wl.items, "cost", seal=True)
        sub = srv.take(keep if keep_script == "submit" else None)
        say(f"  submit: {len(sub)} calls (chunks, the seal), {sum(sub) / items / 1000:.1f}k instructions an item")
        finished = lambda: sum(w.finished for w in ws)  # noqa: E731
        makespan, _ = suite.drive(ws, engines, items, finished, None, 3600.0, wake=cfg.wake)
        for w in ws:  # the last results are written on the turn after they finish
            while w.retry or w.inflight:
                w.turn()
    finally:
        srv.stop()
        thaw()
    kinds: dict[str, list[tuple[int, int]]] = {}
    for kind, n, ir, _busy in log:
        kinds.setdefault(kind, []).append((n, ir))
    res: dict[str, Any] = {"items": items, "workers": workers, "wake": wake, "workload": workload,
                           "submit": sum(sub), "kinds": {}, "makespan_s": makespan}
    for kind, rows in sorted(kinds.items()):
        n = sum(k for k, _ in rows)
        ir = sum(v for _, v in rows)
        res["kinds"][kind] = {"calls": len(rows), "items": n, "instructions": ir,
                              "median_call": statistics.median(v for _, v in rows)}
    res["per_item"] = (sum(sub) + sum(v["instructions"] for v in res["kinds"].values())) / items
    return res


def by_function(out: Path, items: int, top: int = 40) -> str:
    """The whole run's profile (``measure(per_call=False)``) by function, inclusive, in instructions an
    item: which of Redis's commands the scripts call (``hmgetCommand``, ``xaddCommand``, ...) and which
    parts of the Lua VM and the scripting glue (``luaRedisGenericCommand``, ``luaF_findupval``) cost most."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out / "cg.out")],
                          capture_output=True, text=True, check=True).stdout
    lines = [f"  {'k an item':>9s}  function (inclusive)"]
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S*:(\S+)", line) or re.match(r"\s*([\d,]+)\s+\S*:(\S+)", line)
        if m:
            lines.append(f"  {int(m.group(1).replace(',', '')) / items / 1000:9.1f}  {m.group(2)}")
        if len(lines) > top:
            break
    return "\n".join(lines)


def _cut_after_functions(src: str) -> str:
    """``src`` up to the end of its last top-level function, then ``return 1``; claim.lua's idle answer
    (given before the rest is defined) taken out, so that every include is defined."""
    lines = src.split("\n")
    last = max(i for i, line in enumerate(lines) if line.startswith("local function"))
    end = next(i for i in range(last, len(lines)) if lines[i].startswith("end"))
    out = "\n".join(lines[:end + 1]) + "\nreturn 1\n"
    return re.sub(r"local idle_reply, seen = claim_idle\(.*\)\nif idle_reply then return idle_reply end\n",
                  "local seen = {}\n", out)


def definitions(out: Path, calls: int = 5) -> dict[str, tuple[int, int, int]]:
    """Per script: (top-level functions, instructions of a call that defines them all and returns, of a
    call that returns at once); medians of ``calls`` calls."""
    srv = Server(out)
    res = {}
    try:
        for name in ("claim", "complete", "submit"):
            src = S.source(name)
            first = src.split("\n", 1)[0] + "\n" if src.startswith("#!") else ""
            got = []
            for body in (_cut_after_functions(src), first + "return 1\n"):
                sha = srv.r.script_load(body)
                srv.take()
                runs = []
                for _ in range(calls):
                    srv.r.evalsha(sha, 0)
                    runs.append(sum(srv.take()))
                got.append(int(statistics.median(runs)))
            res[name] = (len(re.findall(r"^local function ", src, re.M)), got[0], got[1])
    finally:
        srv.stop()
    return res


def report(res: dict[str, Any]) -> str:
    items = res["items"]
    lines = [f"{items} items, {res['workers']} workers, workload {res.get('workload', 'w2')}, idle wait "
             f"{res['wake']} (instructions inside EVALSHA, "
             "callgrind):",
             f"  submit.lua (+ the seal)              {res['submit'] / items / 1000:8.1f}k an item"]
    for kind, v in res["kinds"].items():
        per_item = v["instructions"] / items / 1000
        extra = f", {v['instructions'] / v['items'] / 1000:.1f}k an item of its own" if v["items"] else ""
        lines.append(f"  {kind:36s} {per_item:8.1f}k an item of the job; {v['calls']} calls, median "
                     f"{v['median_call'] / 1000:.1f}k a call{extra}")
    lines.append(f"  together                             {res['per_item'] / 1000:8.1f}k an item")
    lines.append(f"  simulated makespan {res['makespan_s']:.3f} s (the drive's: pacing must not lengthen it)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=4000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", help="keep callgrind's files here (default: a temporary folder, removed)")
    p.add_argument("--wake", choices=("bell", "poll"), default="bell",
                   help="the drive's idle wait (bench/packing/suite.py SuiteConfig.wake)")
    p.add_argument("--copy", choices=sorted(COPIES), help="the scripts with this part taken out")
    p.add_argument("--definitions", action="store_true", help="what defining the includes' functions costs a call")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w2", help="the job's spec (WORKLOADS)")
    p.add_argument("--by-function", action="store_true",
                   help="no figures per call: the whole run's instructions by function (callgrind_annotate)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cg-") as d:
        out = Path(args.out or d)
        out.mkdir(parents=True, exist_ok=True)
        if args.definitions:
            for name, (n, defined, bare) in definitions(out).items():
                print(f"  {name}.lua: {n} top-level functions, defining them {(defined - bare) / 1000:.1f}k "
                      f"instructions a call ({defined / 1000:.1f}k against {bare / 1000:.1f}k for a bare return)")
            return 0
        if args.by_function:
            measure(args.items, args.workers, out, copy=args.copy, wake=args.wake, workload=args.workload,
                    per_call=False)
            print(by_function(out, args.items))
            return 0
        res = measure(args.items, args.workers, out, copy=args.copy, wake=args.wake, workload=args.workload)
    print(report(res))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
