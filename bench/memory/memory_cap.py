"""Issue 25's figure: a job of any size drains through a Redis of fixed size.

    nice .venv/bin/python -m bench.memory.memory_cap                  # 1,000,000 items, maxmemory 64mb; RESULTS.md
    nice .venv/bin/python -m bench.memory.memory_cap --order backlog-first   # the whole file before any worker
    .venv/bin/python -m bench.memory.memory_cap --quick               # 2,000 items, prints only

Real processes, as a user runs them: a private redis-server (``--maxmemory``, noeviction), a store
directory (the disk tier: ``resident_tokens`` bounds what waits in Redis), ``conductor submit`` of
one file, two ``conductor worker --engine sim`` and a following reader (``conductor results J
--follow -o FILE``). A sampler reads ``used_memory`` while it runs. ``--order fleet-first`` (the
default) starts the workers before the submit; ``backlog-first`` submits the whole file with no
worker running (every item beyond resident_tokens waits in the store, its id in Redis), reads what
Redis holds per store-waiting item, then starts the workers and the reader. The same job then runs through
a Redis without the cap (the peer column: what the job costs when memory is not bounded).
Reported: drained (every id once in the output file), peak used_memory, Redis bytes per item (the
peak over the empty server's memory, per item), wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.report import command_line, git_rev, machine, now_utc, table, write_section  # noqa: E402
from conductor.client import Conductor  # noqa: E402
from conductor.embedded import EmbeddedRedis, child_tie  # noqa: E402
from conductor.formats.lines import parse_line  # noqa: E402
from conductor.tier.object_store import Store  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "capped"
RESIDENT_TOKENS = 50_000  # input tokens waiting in Redis at most; the rest wait in store segments


@dataclass
class CapRun:
    items: int
    maxmemory: str  # "0": no cap
    work: str = ""
    drained: bool = False
    results: int = 0
    duplicates: int = 0
    peak_used: int = 0
    base_used: int = 0
    wall_s: float = 0.0
    stalled: str = ""
    tail: list[str] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)  # bytes by key kind at the end (or the stall)
    at_peak: dict[str, int] = field(default_factory=dict)  # INFO memory figures at the peak sampled
    order: str = "fleet-first"
    stored_items: int = 0  # backlog-first: items waiting in the store once the submit returned
    submit_used: int = 0  # backlog-first: used_memory then

    @property
    def bytes_per_stored(self) -> float:
        """Redis bytes per store-waiting item (backlog-first: used_memory after the submit over the
        empty server's, per stored item: an upper bound, lanes and segment records included)."""
        return (self.submit_used - self.base_used) / max(1, self.stored_items)

    @property
    def bytes_per_item(self) -> float:
        return (self.peak_used - self.base_used) / max(1, self.items)


def memory_by_kind(r: Any) -> dict[str, int]:
    """MEMORY USAGE of every key, summed by its kind (the job and numbers replaced), largest first."""
    out: Counter[str] = Counter()
    for k in r.scan_iter(count=1000):
        name = re.sub(r"\d+", "N", k.decode().replace(f"{{{MODEL}}}", "M").replace(":big", ":J"))
        out[name] += int(r.memory_usage(k) or 0)
    return dict(out.most_common(8))


def follow(c: Conductor, res: CapRun, cmd: list[str], env: dict[str, str], t0: float, stall_s: float,
           timeout_s: float) -> None:
    """Run the following reader until it exits, or until no result came for ``stall_s``."""
    err_path = Path(res.work) / "reader.err"
    with err_path.open("wb") as err_f:
        reader = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=err_f,
                                  preexec_fn=child_tie())
    last, last_t = -1, time.monotonic()
    while reader.poll() is None:
        time.sleep(0.5)
        done = int(c.r.hget(f"cdr:{{{MODEL}}}:job:big", "completed") or 0)
        if done != last:
            last, last_t = done, time.monotonic()
        elif time.monotonic() - last_t > stall_s or time.monotonic() - t0 > timeout_s:
            res.stalled = f"no result for {stall_s:.0f} s after {done:,} of {res.items:,}"
            reader.kill()
            break
    reader.wait()
    res.wall_s = time.monotonic() - t0
    if not res.stalled and reader.returncode != 0:
        err = err_path.read_text(errors="replace")[-300:].strip()
        res.stalled = f"results exited {reader.returncode}: {err}"


def write_input(path: Path, n: int) -> None:
    """``n`` small items over 8 shapes (ids ``i-0000000``...)."""
    prefixes = [[f"You are labeller {s}. Answer with one word."] for s in range(8)]
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"i-{i:07d}", "model": MODEL, "prefix": prefixes[i % 8],
                                "prompt": f"label item {i}", "input_tokens": 20 + i % 40,
                                "max_tokens": 8}, separators=(",", ":")) + "\n")


def _sample(c: Conductor, res: CapRun, stop: threading.Event) -> None:
    """Read used_memory every 0.1 s until ``stop``, keeping the peak and its INFO figures."""
    while not stop.is_set():
        try:
            info = c.r.info("memory")
            if int(info["used_memory"]) > res.peak_used:
                res.peak_used = int(info["used_memory"])
                res.at_peak = {k: int(info[k]) for k in ("used_memory_dataset", "mem_clients_normal",
                                                         "used_memory_scripts", "used_memory_lua")}
        except Exception:  # noqa: BLE001 - a sample missed is not a failure
            pass
        stop.wait(0.1)


def run(n: int, maxmemory: str, work: Path, *, stall_s: float = 60.0, timeout_s: float = 3600.0,
        workers: int = 2, resident_tokens: int = RESIDENT_TOKENS, order: str = "fleet-first") -> CapRun:
    """One job of ``n`` items through a Redis capped at ``maxmemory`` ("0": no cap); ``order``
    fleet-first (workers, then the submit) or backlog-first (the submit, then workers)."""
    if order not in ("fleet-first", "backlog-first"):
        raise ValueError(f"order: fleet-first or backlog-first, not {order!r}")
    res = CapRun(n, maxmemory, str(work), order=order)
    work.mkdir(parents=True, exist_ok=True)
    inp, out, store = work / "in.jsonl", work / "out.jsonl", work / "store"
    write_input(inp, n)
    extra = ["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"]
    with EmbeddedRedis(extra=extra) as srv:
        c = Conductor.from_url(srv.url, store=Store(str(store)))
        c.ensure_model(MODEL)
        c.set_config(MODEL, {"quiet_ms": 200, "resident_tokens": resident_tokens})
        res.base_used = int(c.r.info("memory")["used_memory"])
        env = dict(os.environ, CONDUCTOR_REDIS_URL=srv.url, CONDUCTOR_STORE=str(store))
        base = [sys.executable, "-m", "conductor", "--log-level", "warning"]
        stop = threading.Event()
        sampler = threading.Thread(target=_sample, args=(c, res, stop), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        procs: list[subprocess.Popen[bytes]] = []
        logs = [work / f"w{k}.log" for k in range(workers)]
        def start_workers() -> None:
            for k in range(workers):
                with logs[k].open("wb") as log_f:
                    procs.append(subprocess.Popen(
                        [*base, "worker", "--engine", "sim", "--model", MODEL, "--name", f"w{k}",
                         "--max-batch-size", "256", "--max-batch-tokens", "16384", "--max-input-len", "4096"],
                        env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log_f, preexec_fn=child_tie()))

        try:
            if order == "fleet-first":
                start_workers()
            sub = subprocess.run([*base, "submit", str(inp), "--job", "big", "--create"], env=env, cwd=str(ROOT),
                                 capture_output=True, timeout=timeout_s)
            if order == "backlog-first":
                res.submit_used = int(c.r.info("memory")["used_memory"])
                res.stored_items = int(c.r.hget(f"cdr:{{{MODEL}}}:intake", "stored_items") or 0)
                if sub.returncode == 0:
                    start_workers()
            if sub.returncode != 0:
                res.stalled = f"submit exited {sub.returncode}: {sub.stderr.decode()[-300:].strip()}"
            else:
                follow(c, res, [*base, "results", "big", "--follow", "-o", str(out)], env, t0, stall_s, timeout_s)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            stop.set()
            sampler.join()
        # the server's own peak: the sampler reads every 0.1 s and can miss a short one
        res.peak_used = max(res.peak_used, int(c.r.info("memory")["used_memory_peak"]))
        res.by_kind = memory_by_kind(c.r)
        for lg in logs:
            res.tail += lg.read_text(errors="replace").splitlines()[-3:]
    part = out if out.exists() else out.with_name(out.name + ".part")
    ids = Counter(json.loads(line)["id"] for line in part.read_text().splitlines()) if part.exists() else Counter()
    res.results = len(ids)
    res.duplicates = sum(v - 1 for v in ids.values() if v > 1)
    res.drained = not res.stalled and res.results == n and res.duplicates == 0
    return res


def registry_bytes(n: int) -> tuple[float, float]:
    """Bytes of Redis per answered item in a job's id registry and done marks (MEMORY USAGE of
    M:in:J:sums and M:job:J:items, all samples), then of its packed form after compact_ids.lua: a
    job of ``n`` items submitted, claimed and completed through the library."""
    from conductor.redis_contract import keys as K
    from conductor.redis_contract.records import Contract, Result
    from conductor.tier.compact_ids import compact_model

    with EmbeddedRedis() as srv:
        c = Conductor.from_url(srv.url)
        c.ensure_model(MODEL)
        c.set_config(MODEL, {"quiet_ms": 0, "release_batches": 0, "activate_batches": 0})
        items = [parse_line(json.dumps({"id": f"i-{i:07d}", "model": MODEL, "prefix": ["p"], "prompt": "x",
                                        "input_tokens": 20 + i % 40, "max_tokens": 8})) for i in range(n)]
        c.submit(items, "big")
        con = Contract(model=MODEL, max_batch_size=512, max_batch_tokens=65536, max_input_len=4096)
        while True:
            b, why = c.claim(con, "w")
            if b is None:
                if why == "idle":
                    break
                continue
            c.complete(b, [Result(id=it.id, model=MODEL, job=it.job, output="ok", output_tokens=1, error=None,
                                  shape=b.shape, epoch=b.epoch, lane=b.lane, batch=b.batch_id,
                                  batch_size=len(b.items), batch_padded_len=b.padded_len,
                                  input_tokens=it.input_tokens, worker="w", claimed_at=b.claimed_at, finished_at=0)
                           for it in b.items])
        mk = K.ModelKeys(MODEL)

        def usage(*keys: str) -> int:
            return sum(int(c.r.memory_usage(k, samples=0) or 0) for k in keys)

        before = usage(mk.job_sums("big"), mk.job_items("big"))
        compact_model(c, MODEL, min_done=1)
        after = usage(mk.job_sums("big"), mk.job_items("big"), mk.job_packed("big"))
    return before / n, after / n


def report(capped: CapRun, plain: CapRun) -> str:
    def row(name: str, f: CapRun) -> list[object]:
        return [name, "yes" if f.drained else f"NO ({f.stalled or f'{f.results:,} ids'})", f"{f.results:,}",
                f"{f.peak_used / 2**20:.1f}", f"{f.bytes_per_item:.1f}", f"{f.wall_s:.1f}"]
    return table(["run", "drained, every id once", "results", "peak used_memory (MiB)", "Redis bytes per item",
                  "wall (s)"],
                 [row(f"maxmemory {capped.maxmemory} (noeviction)", capped), row("no cap (peer)", plain)])


BACKLOG_SECTION = "Memory cap, backlog first: the whole file waits before any worker runs (issue 25)"


def backlog_first(n: int, maxmemory: str, stall_s: float, *, write: bool) -> int:
    """The backlog-first run through the capped Redis (no peer: the fleet-first section has it)."""
    work = Path(tempfile.mkdtemp(prefix="memcap-"))
    try:
        res = run(n, maxmemory, work / "capped", stall_s=stall_s, order="backlog-first")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = table(["run", "submit accepted", "stored items after the submit", "used_memory then (MiB)",
                  "Redis bytes per store-waiting item", "drained, every id once", "results",
                  "peak used_memory (MiB)", "wall (s)"],
                 [[f"maxmemory {maxmemory} (noeviction), backlog first", "no" if "submit" in res.stalled else "yes",
                   f"{res.stored_items:,}", f"{res.submit_used / 2**20:.1f}", f"{res.bytes_per_stored:.1f}",
                   "yes" if res.drained else f"NO ({res.stalled or f'{res.results:,} ids'})", f"{res.results:,}",
                   f"{res.peak_used / 2**20:.1f}", f"{res.wall_s:.1f}"]])
    print(body)
    if write:
        with EmbeddedRedis() as srv:
            import redis
            mach = machine(redis.Redis.from_url(srv.url))
        write_section(BACKLOG_SECTION,
                      f"`nice {command_line()}` at commit {git_rev()}, {now_utc()}; {mach}.\n\n"
                      f"{n:,} items as above, `conductor submit` of the whole file with no worker running "
                      f"(resident_tokens {RESIDENT_TOKENS:,}: the rest waits in store segments), then two sim workers "
                      "and `conductor results --follow`. Bytes per store-waiting item: used_memory once the submit "
                      "returned over the empty server's, per stored item (an upper bound: the lanes' items and the "
                      "segment records are in it). Wall time from the submit's start.\n\n" + body)
    return 0 if res.drained else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--maxmemory", default="64mb")
    p.add_argument("--quick", action="store_true", help="2,000 items, maxmemory 64mb, print only")
    p.add_argument("--stall-s", type=float, default=120.0)
    p.add_argument("--order", choices=["fleet-first", "backlog-first"], default="fleet-first",
                   help="workers before the submit (default), or the whole file submitted before any worker")
    a = p.parse_args(argv)
    n = 2000 if a.quick else a.items
    if a.order == "backlog-first":
        return backlog_first(n, a.maxmemory, a.stall_s, write=not a.quick)
    work = Path(tempfile.mkdtemp(prefix="memcap-"))
    try:
        capped = run(n, a.maxmemory, work / "capped", stall_s=a.stall_s)
        plain = run(n, "0", work / "plain", stall_s=a.stall_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = report(capped, plain)
    reg_n = 2000 if a.quick else 200_000
    before, after = registry_bytes(reg_n)
    body += (f"\n\nThe id registry and done marks of a job of {reg_n:,} answered items (MEMORY USAGE, all "
             f"samples): {before:.1f} bytes an item as the main branch keeps them, {after:.1f} packed "
             f"({before / after:.1f}x less).")
    print(body)
    if not a.quick:
        with EmbeddedRedis() as srv:
            import redis
            mach = machine(redis.Redis.from_url(srv.url))
        write_section("Memory cap: a job larger than Redis memory (issue 25)",
                      f"`nice {command_line()}` at commit {git_rev()}, {now_utc()}; {mach}.\n\n"
                      f"{n:,} items of 20-59 input tokens over 8 shapes, `conductor submit` of one file with a store "
                      f"(resident_tokens {RESIDENT_TOKENS:,}), two sim workers and `conductor results --follow`. "
                      "The peer column is the same job through a Redis without maxmemory; bytes per item are the "
                      "peak used_memory over the empty server's, per item.\n\n" + body)
    return 0 if capped.drained and plain.drained else 1


if __name__ == "__main__":
    sys.exit(main())
