"""Idle fleet and request path (issue 16): what idle workers cost Redis, polling against the
doorbell, how fast an idle worker wakes, and request latency through RequestClient.

    .venv/bin/python bench/broker/idle_fleet.py [--fleets 20,200] [--seconds 5] [--write-results]

Idle workers run as threads of this process (one Conductor and connection each, sim engine),
so 200 of them fit on a small machine; Redis's side (INFO commandstats, used_cpu_sys+user) is
what is measured. The request figures use one `conductor worker` process (sim, time scale 0).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.report import command_line, machine, median, now_utc, pct, table, write_section  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.client.request import RequestClient  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.formats.native import from_native  # noqa: E402
from conductor.workers.engines.sim import SimEngine  # noqa: E402
from conductor.workers.worker import Worker, WorkerOptions  # noqa: E402

QUICK = {"quiet_ms": 50, "release_batches": 0, "activate_batches": 0}


def cpu(r) -> float:  # noqa: ANN001
    i = r.info("cpu")
    return float(i["used_cpu_sys"]) + float(i["used_cpu_user"])


def idle_fleet(url: str, n: int, wake: str, seconds: float, wakes: int = 15, settle_s: float = 3.0) -> dict:
    r = connect(url)
    r.flushall()
    Conductor(r).set_config("m", QUICK)
    workers = [Worker(Conductor(connect(url)), SimEngine("m", max_batch_size=8, max_batch_tokens=8192),
                      WorkerOptions(name=f"{wake}{i}", wake=wake)) for i in range(n)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    time.sleep(settle_s + n / 50)  # registered, past start-up
    r.config_resetstat()
    c0, t0 = cpu(r), time.monotonic()
    time.sleep(seconds)
    stats, c1, took = r.info("commandstats"), cpu(r), time.monotonic() - t0
    # commandstats counts the commands scripts run inside Redis too
    calls = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_config|resetstat", "cmdstat_info"))
    # wake-up: one item submitted (and sealed) to the idle fleet, submit to claim on Redis's clock
    c = Conductor(r)
    lat = []
    for k in range(wakes):
        s, us = r.time()
        at = s * 1000 + us / 1000
        c.submit([from_native({"id": f"x{k}", "model": "m", "prompt": "p", "max_tokens": 4})], "wake", seal=True)
        while len(rows := c.read_results("wake")) <= k:
            time.sleep(0.002)
        lat.append(rows[k].claimed_at - at)
        time.sleep(0.2 + (0.5 if wake == "poll" else 0))  # idle again (the poller backs off to its cap)
    for w in workers:
        w.request_stop()
    for t in threads:
        t.join(10)
    return {"n": n, "wake": wake, "cmds_s": calls / took, "per_worker": calls / took / n,
            "scripts_per_worker": stats.get("cmdstat_evalsha", {}).get("calls", 0) / took / n,
            "cpu_pct": 100 * (c1 - c0) / took, "wake_ms": median(lat)}


def requests(url: str, seq: int) -> dict:
    r = connect(url)
    r.flushall()
    Conductor(r).set_config("m", QUICK)
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    p = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                          "--model", "m", "--name", "rw", "--max-batch-size", "64", "--max-batch-tokens", "8192",
                          "--max-input-len", "4096", "--sim-time-scale", "0"], env=env, cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                rc = RequestClient(url, model="m")
                break
            except Exception:  # noqa: BLE001 - the worker is still starting
                assert time.monotonic() < deadline
                time.sleep(0.1)
        for _ in range(20):
            rc.generate("warm", max_tokens=4, timeout=10)
        r.config_resetstat()
        lat = []
        for k in range(seq):
            t = time.perf_counter()
            rc.generate(f"p{k}", max_tokens=4, timeout=10)
            lat.append((time.perf_counter() - t) * 1000)
        stats = r.info("commandstats")
        server_us = sum(v["usec"] for k, v in stats.items() if k != "cmdstat_config|resetstat") / seq
        conc = []

        def one(k: int) -> None:
            t = time.perf_counter()
            rc.generate(f"c{k}", max_tokens=4, timeout=60)
            conc.append((time.perf_counter() - t) * 1000)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(300) as ex:
            list(ex.map(one, range(300)))
        wall = time.perf_counter() - t0
        rc.close()
        return {"p50": pct(lat, 50), "p99": pct(lat, 99), "server_us": server_us, "conc_p50": pct(conc, 50),
                "conc_p99": pct(conc, 99), "conc_wall": wall, "permits_back": rc.available_permits}
    finally:
        p.terminate()
        p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fleets", default="20,200")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--wakes", type=int, default=15, help="wake-ups measured per fleet (the median is reported)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="seconds for a fleet to register before measuring")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    srv = EmbeddedRedis().start()
    try:
        r = connect(srv.url)
        where = machine(r)
        rows = []
        for n in (int(x) for x in args.fleets.split(",")):
            for wake in ("poll", "bell"):
                f = idle_fleet(srv.url, n, wake, args.seconds, args.wakes, args.settle_s)
                print(f, flush=True)
                rows.append([n, "poll (back-off to 50 ms)" if wake == "poll" else "doorbell (BLPOP)",
                             f"{f['cmds_s']:.0f}", f"{f['per_worker']:.1f}", f"{f['scripts_per_worker']:.1f}",
                             f"{f['cpu_pct']:.1f}",
                             f"{f['wake_ms']:.1f}"])
        q = requests(srv.url, args.requests)
        print(q, flush=True)
    finally:
        srv.close()
    body = (f"## Idle fleet and request path (issue 16)\n\nCommand: `{command_line()}`  \n"
            f"Run: {now_utc()}; {where}.  \nIdle workers are threads of the benchmark's process (one "
            f"Conductor and connection each, sim engine, model thresholds quiet_ms=50); Redis's side is "
            f"measured over {args.seconds:g} s idle (INFO commandstats, used_cpu_sys+user). Wake-up: "
            f"one sealed item submitted to the idle fleet, median over {args.wakes} of claimed_at minus the "
            f"submit's start, both on Redis's clock. The lease holder's maintenance sweep (1 s timer: "
            f"reclaim sweep, thrash alarm, retention) is part of every row.\n\n"
            + table(["idle workers", "wait", "commands/s (INFO commandstats: with those scripts run inside Redis)",
                     "per worker", "script calls/s per worker", "Redis CPU %", "wake-up ms (median)"], rows)
            + f"\n\nRequest path (`RequestClient`, one `conductor worker` process, sim at time scale 0): "
            f"{args.requests} sequential requests p50 {q['p50']:.2f} ms, p99 {q['p99']:.2f} ms, of which "
            f"Redis's server time {q['server_us'] / 1000:.3f} ms per request (all commands: submit, seal, "
            f"BLPOP, claim, complete, heartbeat); 300 concurrent requests (threads) under 64 permits: "
            f"p50 {q['conc_p50']:.1f} ms, p99 {q['conc_p99']:.1f} ms, {q['conc_wall']:.2f} s for all, "
            f"{q['permits_back']} of 64 permits back after.\n")
    print(body)
    if args.write_results:
        write_section("idle_fleet", body)


if __name__ == "__main__":
    main()
