"""Idle fleet and request path (issue 16): what idle workers cost Redis, polling against the
doorbell, how fast an idle worker wakes, and request latency through RequestClient.

    .venv/bin/python bench/broker/idle_fleet.py [--fleets 20,200] [--seconds 5] [--write-results]

``--idle-goal`` (issue 36: an idle worker at most 1 command and 50 us of Redis CPU a second) measures
what each idle worker sends (bench/common/sent.py: counted on its own connections, the lease
holder apart), the server's CPU over an empty baseline, and the wake-up, ``--repeats`` times per fleet:

    .venv/bin/python bench/broker/idle_fleet.py --idle-goal --fleets 2,16,32 --seconds 10 --repeats 3 \
        --wakes 15 --write-results

``--sharded`` (issue 36: the same goal on a sharded model) does it on a Redis Cluster of each
``--masters`` count this process starts, for a model of ``shards`` = 1 and = the masters, each worker
a consumer on every shard; the wake-up's item is placed on the last shard:

    .venv/bin/python bench/broker/idle_fleet.py --sharded --masters 3 6 --fleets 8,32 --seconds 10 \
        --repeats 2 --wakes 15 --write-results

Idle workers run as threads of this process (one Conductor and connection each, sim engine),
so 200 of them fit on a small machine; Redis's side (INFO commandstats, used_cpu_sys+user) is
what is measured. The request figures use one `conductor worker` process (sim, time scale 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.common import sent  # noqa: E402
from bench.common.report import command_line, git_rev, machine, median, now_utc, pct, table, write_section  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.client.request import AsyncRequestClient, RequestClient  # noqa: E402
from conductor.embedded import EmbeddedCluster, EmbeddedRedis, child_tie  # noqa: E402
from conductor.formats.native import from_native  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402
from conductor.redis_contract import shards as S  # noqa: E402
from conductor.workers.engines.sim import SimEngine  # noqa: E402
from conductor.workers.worker import Worker, WorkerOptions  # noqa: E402

MK = K.ModelKeys("m")
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
    lat = wake_ups(r, wakes, 0.2 + (0.5 if wake == "poll" else 0))  # idle again (the poller backs off to its cap)
    for w in workers:
        w.request_stop()
    for t in threads:
        t.join(10)
    return {"n": n, "wake": wake, "cmds_s": calls / took, "per_worker": calls / took / n,
            "scripts_per_worker": stats.get("cmdstat_evalsha", {}).get("calls", 0) / took / n,
            "cpu_pct": 100 * (c1 - c0) / took, "wake_ms": median(lat)}


def wake_ups(r, wakes: int, pause_s: float = 0.3) -> list[float]:  # noqa: ANN001
    """One sealed item submitted to the idle fleet at a time: submit to claim, on Redis's clock."""
    c = Conductor(r)
    lat = []
    for k in range(wakes):
        s, us = r.time()
        at = s * 1000 + us / 1000
        c.submit([from_native({"id": f"x{k}", "model": "m", "prompt": "p", "max_tokens": 4})], "wake", seal=True)
        while len(rows := c.read_results("wake")) <= k:
            time.sleep(0.002)
        lat.append(rows[k].claimed_at - at)
        time.sleep(pause_s)  # idle again
    return lat


def server_window(r, seconds: float) -> tuple[float, dict, float]:  # noqa: ANN001
    """Redis's CPU seconds and INFO commandstats over ``seconds``, and the window's length."""
    r.config_resetstat()
    c0, t0 = cpu(r), time.monotonic()
    time.sleep(seconds)
    stats, c1 = r.info("commandstats"), cpu(r)
    return c1 - c0, stats, time.monotonic() - t0


def idle_goal(url: str, n: int, seconds: float, wakes: int, settle_s: float) -> dict:
    """``n`` idle workers on one model: what each sends, what Redis spends, how fast one wakes."""
    r = connect(url)
    r.flushall()
    Conductor(r).set_config("m", QUICK)
    base_cpu, _, base_took = server_window(r, min(seconds, 3.0)) if n else (0.0, {}, 1.0)
    workers = [Worker(Conductor(connect(url)), SimEngine("m", max_batch_size=8, max_batch_tokens=8192),
                      WorkerOptions(name=f"i{i}")) for i in range(n)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    time.sleep(settle_s + n / 50)  # registered, past start-up, each through its first beat
    for w in workers:  # each a consumer of the group, as a worker is once it has claimed (the sweep visits each)
        r.xgroup_createconsumer(MK.batches, K.GROUP, w.name)
    sent.reset()
    used, stats, took = server_window(r, seconds)
    per = {w.name: sent.of(w.c.r) / took for w in workers}
    holder = (r.get(MK.maint_lease) or b"").decode()
    lat = wake_ups(r, wakes)
    for w in workers:
        w.request_stop()
    for t in threads:
        t.join(15)
    calls = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_config|resetstat", "cmdstat_info"))
    others = [v for k, v in per.items() if k != holder]
    return {"n": n, "sent_per_other": sum(others) / max(1, len(others)), "sent_max_other": max(others, default=0.0),
            "sent_holder": per.get(holder, 0.0), "server_cmds_per_worker": calls / took / n,
            "evalsha_per_worker": stats.get("cmdstat_evalsha", {}).get("calls", 0) / took / n,
            "cpu_us_s": 1e6 * used / took, "base_us_s": 1e6 * base_cpu / base_took, "wake_ms": median(lat),
            "wake_max_ms": max(lat)}


def _nodes(cl: EmbeddedCluster) -> list[redis.Redis]:
    return [redis.Redis(port=n.port) for n in cl.nodes]


def cluster_window(nodes: list[redis.Redis], seconds: float) -> tuple[float, dict[str, int], float, float]:
    """The cluster's CPU seconds (every node's together), its commandstats calls by command and the
    commands' own time (usec, us) over ``seconds``, and the window's length."""
    for r in nodes:
        r.config_resetstat()
    c0, t0 = sum(cpu(r) for r in nodes), time.monotonic()
    time.sleep(seconds)
    calls: dict[str, int] = {}
    usec = 0.0
    for r in nodes:
        for k, v in r.info("commandstats").items():
            calls[k] = calls.get(k, 0) + int(v["calls"])
            if k not in ("cmdstat_config|resetstat", "cmdstat_info"):
                usec += float(v["usec"])
    return sum(cpu(r) for r in nodes) - c0, calls, usec, time.monotonic() - t0


def idle_goal_sharded(cl: EmbeddedCluster, shards: int, n: int, seconds: float, wakes: int) -> dict:
    """``n`` idle workers on one model of ``shards`` shards over the cluster ``cl``: what each sends,
    what the masters spend, how fast one wakes for an item placed on the last shard."""
    nodes = _nodes(cl)
    for r in nodes:
        r.flushall()
    c = Conductor(connect(cl.url))
    c.set_config("m", {**QUICK, "shards": shards})
    names = ["m", *[x for x in c.shards("m") if x != "m"]]
    base_cpu, _, _, base_took = cluster_window(nodes, min(seconds, 3.0))
    workers = [Worker(Conductor(connect(cl.url)), SimEngine("m", max_batch_size=8, max_batch_tokens=8192),
                      WorkerOptions(name=f"i{i}")) for i in range(n)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60 + n
    # each through its first idle beat (a shard's too): what follows is the steady idle wait
    while not all(w.last_claim == "idle" and w.idle is not None and w.idle.beats
                  and (shards == 1 or w.idle.shard_beats) for w in workers):
        if time.monotonic() > deadline:
            raise RuntimeError("the fleet did not go idle")
        time.sleep(0.1)
    time.sleep(1.0)
    for name in names:  # each a consumer of every shard's group, as a worker is once it has claimed there
        for w in workers:
            c.r.xgroup_createconsumer(K.ModelKeys(name).batches, K.GROUP, w.name)
    sent.reset()
    # a holder at the window's start or end is one (a lease that passed on meanwhile: both)
    holders = {(c.r.get(K.ModelKeys(x).maint_lease) or b"").decode() for x in names}
    used, stats, usec, took = cluster_window(nodes, seconds)
    per = {w.name: sent.of(w.c.r) / took for w in workers}
    holders |= {(c.r.get(K.ModelKeys(x).maint_lease) or b"").decode() for x in names}
    lat = wake_ups_on(c, "m", shards, wakes)
    for w in workers:
        w.request_stop()
    for t in threads:
        t.join(15)
    for r in nodes:
        r.close()
    calls = sum(v for k, v in stats.items() if k not in ("cmdstat_config|resetstat", "cmdstat_info"))
    others = [v for k, v in per.items() if k not in holders]
    held = [v for k, v in per.items() if k in holders]
    return {"masters": len(cl.nodes), "shards": shards, "n": n,
            "sent_per_other": sum(others) / max(1, len(others)), "sent_max_other": max(others, default=0.0),
            "holders": len(held), "sent_per_holder": sum(held) / max(1, len(held)),
            "server_cmds_per_worker": calls / took / n,
            "sent_seen_per_worker": sum(stats.get(f"cmdstat_{k}", 0) for k in ("evalsha", "blpop")) / took / n,
            "cpu_us_s": 1e6 * used / took, "base_us_s": 1e6 * base_cpu / base_took, "usec_s": usec / took,
            "wake_ms": median(lat), "wake_max_ms": max(lat)}


def wake_ups_on(c: Conductor, model: str, shards: int, wakes: int, pause_s: float = 0.3) -> list[float]:
    """As ``wake_ups``, each item placed on the model's last shard (its shape recorded there first)."""
    lat = []
    for k in range(wakes):
        it = from_native({"id": f"x{k}", "model": model, "prompt": "p", "max_tokens": 4})
        if shards > 1:
            c.r.hset(K.ModelKeys(model).shard_of, it.sig, shards - 1)
        s, us = c.r.time()
        at = s * 1000 + us / 1000
        c.submit([it], "wake", seal=True)
        while len(rows := c.read_results("wake")) <= k:
            time.sleep(0.002)
        lat.append(rows[k].claimed_at - at)
        time.sleep(pause_s)
    if shards > 1:
        assert c.status("wake")["models"][S.shard_name(model, shards - 1, shards)]["submitted"] == wakes
    return lat


def sharded_main(args: argparse.Namespace) -> None:
    sent.install()
    fleets = [int(x) for x in args.fleets.split(",")]
    runs: dict[tuple[int, int, int], list[dict]] = {}
    where = machine()
    for masters in args.masters:
        with EmbeddedCluster(masters) as cl:
            for _ in range(args.repeats):
                for shards in (1, masters):  # the unsharded model on the same cluster: the peer
                    for n in fleets:
                        f = idle_goal_sharded(cl, shards, n, args.seconds, args.wakes)
                        print(f, flush=True)
                        runs.setdefault((masters, shards, n), []).append(f)
    rows, slopes = [], []
    for (masters, shards, n), fs in runs.items():
        rows.append([masters, shards, n, f"{median([f['sent_per_other'] for f in fs]):.2f}",
                     f"{median([f['sent_max_other'] for f in fs]):.2f}",
                     f"{median([f['holders'] for f in fs]):.0f}", f"{median([f['sent_per_holder'] for f in fs]):.1f}",
                     f"{median([f['sent_seen_per_worker'] for f in fs]):.2f}",
                     f"{median([f['server_cmds_per_worker'] for f in fs]):.1f}",
                     f"{median([f['usec_s'] / n for f in fs]):.1f}",
                     f"{median([f['base_us_s'] for f in fs]):.0f}", f"{median([f['cpu_us_s'] for f in fs]):.0f}",
                     f"{median([f['wake_ms'] for f in fs]):.1f}", f"{max(f['wake_max_ms'] for f in fs):.1f}"])
    for masters in args.masters:
        for shards in (1, masters):
            fs = [f for (m, s, _), got in runs.items() if (m, s) == (masters, shards) for f in got]
            two = len({f["n"] for f in fs}) > 1
            slope = least_squares([(f["n"], f["usec_s"]) for f in fs]) if two else float("nan")
            cpu_slope = least_squares([(f["n"], f["cpu_us_s"] - f["base_us_s"]) for f in fs]) if two else float("nan")
            slopes.append([masters, shards, f"{slope:.1f}", f"{slope * 1000 / 1e4:.1f} %", f"{cpu_slope:.1f}"])
    body = (f"## Idle workers of a sharded model: commands and Redis CPU per idle worker (issue 36)\n\n"
            f"Command: `{command_line()}`  \nRun: {now_utc()}, commit {git_rev()}; {where}.  \n"
            f"A Redis Cluster of each size (conductor/embedded.py, one redis-server per master, slots split "
            f"evenly) and one model on it, unsharded (shards = 1: the peer) and over every master; idle workers "
            f"are threads of the benchmark's process (one Conductor and cluster client each, sim engine, heartbeat "
            f"TTL 10 s), each a consumer of every shard's group; nothing is submitted while they are measured. "
            f"Sent: commands each worker sent over {args.seconds:g} s, counted on its own connections to every node "
            f"(bench/common/sent.py), the holders of a maintenance lease (the model's and each shard's, at the "
            f"window's start or end) apart; "
            f"seen: the script calls and BLPOPs the masters counted (INFO commandstats), per worker, holders "
            f"included; all commands: everything commandstats counted, the commands scripts run inside Redis "
            f"included; commands' time: their INFO commandstats usec, all masters, per worker. CPU: "
            f"used_cpu_sys+user of every master together over the window, and over "
            f"{min(args.seconds, 3.0):g} s before the workers start (the empty cluster's own timers and bus). "
            f"Wake-up: one sealed item placed on the model's last shard, submit to claim on Redis's clock, "
            f"{args.wakes} per run. Medians over {args.repeats} runs.\n\n"
            + table(["masters", "shards", "idle workers", "sent/s per worker (not a holder)", "worst (not a holder)",
                     "lease holders", "sent/s per holder", "seen/s per worker (scripts, BLPOP)",
                     "all commands/s per worker", "commands' time us/s per worker", "CPU us/s, empty",
                     "CPU us/s, fleet",
                     "wake-up ms from the last shard (median)", "wake-up ms (worst)"], rows)
            + "\n\nMarginal server time of one more idle worker, all masters together: the slope of a least-squares "
            "line through every run's (workers, the commands' own time: INFO commandstats usec, scripts whole, "
            "holders' sweeps included) for the model (the holders' fixed part cancels; their per-consumer part "
            "stays in), 1,000 idle workers as a share of one core; and the same slope of used_cpu_sys+user over "
            "the empty cluster's (which adds the event loop's reads and writes, and the noise of two shared "
            "cores: 6 masters' own timers and bus take 9 to 17 ms a second here).\n\n"
            + table(["masters", "shards", "us/s per idle worker (commands' time)", "1,000 idle workers",
                     "us/s per idle worker (CPU over empty)"], slopes) + "\n")
    print(body)
    if args.write_results:
        write_section("idle_sharded", body)


def least_squares(points: list[tuple[float, float]]) -> float:
    """The slope of the least-squares line through ``points`` (nan with fewer than two x values)."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else float("nan")


def idle_goal_main(args: argparse.Namespace) -> None:
    sent.install()
    srv = EmbeddedRedis().start()
    rows, runs = [], {}
    try:
        where = machine(connect(srv.url))
        fleets = [int(x) for x in args.fleets.split(",")]
        for _ in range(args.repeats):
            for n in fleets:  # interleaved, so that a burst of load on the machine spreads over the fleets
                f = idle_goal(srv.url, n, args.seconds, args.wakes, args.settle_s)
                print(f, flush=True)
                runs.setdefault(n, []).append(f)
    finally:
        srv.close()
    for n in fleets:
        fs = runs[n]
        cpu_over = median([f["cpu_us_s"] - f["base_us_s"] for f in fs])
        rows.append([n, f"{median([f['sent_per_other'] for f in fs]):.2f}",
                     f"{median([f['sent_max_other'] for f in fs]):.2f}",
                     f"{median([f['sent_holder'] for f in fs]):.1f}",
                     f"{median([f['server_cmds_per_worker'] for f in fs]):.1f}",
                     f"{median([f['evalsha_per_worker'] for f in fs]):.2f}",
                     f"{median([f['base_us_s'] for f in fs]):.0f}", f"{median([f['cpu_us_s'] for f in fs]):.0f}",
                     f"{cpu_over / n:.0f}", f"{median([f['wake_ms'] for f in fs]):.1f}",
                     f"{max(f['wake_max_ms'] for f in fs):.1f}"])
    slope = least_squares([(f["n"], f["cpu_us_s"]) for fs in runs.values() for f in fs])
    body = (f"## Idle workers: commands and Redis CPU per idle worker (issue 36)\n\nCommand: `{command_line()}`  \n"
            f"Run: {now_utc()}, commit {git_rev()}; {where}.  \n"
            f"Idle workers are threads of the benchmark's process (one Conductor and connection each, sim engine, "
            f"thresholds quiet_ms=50, heartbeat TTL 10 s); nothing is submitted while they are measured. Sent: "
            f"commands each worker sent over {args.seconds:g} s, counted on its own connections "
            f"(bench/common/sent.py: a pipeline counts each command, a script call one), the maintenance lease holder "
            f"apart; INFO commandstats counts the commands scripts run inside Redis as well. Redis CPU: "
            f"used_cpu_sys+user over the window, and over {min(args.seconds, 3.0):g} s before the workers start "
            f"(the empty server's own timers). Wake-up: one sealed item submitted to the idle fleet, "
            f"submit to claim on Redis's clock, {args.wakes} per run. Medians over {args.repeats} runs per fleet, "
            f"fleets interleaved.\n\n"
            + table(["idle workers", "sent/s per worker (not the holder)", "worst worker (not the holder)",
                     "sent/s, lease holder", "commandstats calls/s per worker", "script calls/s per worker",
                     "Redis CPU us/s, empty", "Redis CPU us/s, fleet", "over empty, per worker (us/s)",
                     "wake-up ms (median)", "wake-up ms (worst)"], rows)
            + f"\n\nMarginal Redis CPU of one more idle worker: {slope:.1f} us/s, the slope of a least-squares line "
            f"through every run's (workers, Redis CPU us/s) (the empty server's timers and the holder's fixed part "
            f"cancel; its per-consumer part stays in): 1,000 idle workers {slope * 1000 / 1e4:.1f} % of a core, "
            f"plus the holder.\n")
    print(body)
    if args.write_results:
        write_section("idle_goal", body)


def requests(url: str, seq: int) -> dict:
    r = connect(url)
    r.flushall()
    Conductor(r).set_config("m", QUICK)
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    p = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                          "--model", "m", "--name", "rw", "--max-batch-size", "64", "--max-batch-tokens", "8192",
                          "--max-input-len", "4096", "--sim-time-scale", "0"], env=env, cwd=str(ROOT),
                         preexec_fn=child_tie())
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
        out = {"p50": pct(lat, 50), "p99": pct(lat, 99), "server_us": server_us, "conc_p50": pct(conc, 50),
               "conc_p99": pct(conc, 99), "conc_wall": wall, "permits_back": rc.available_permits}
        return out | asyncio.run(async_requests(url, seq))
    finally:
        p.terminate()
        p.wait(30)


async def async_requests(url: str, seq: int) -> dict:
    """The same through AsyncRequestClient: ``seq`` requests one after another, then 300 at once (one
    event loop, no threads of the caller's)."""
    async with AsyncRequestClient(url, model="m") as rc:
        for _ in range(20):
            await rc.generate("warm", max_tokens=4, timeout=10)
        lat = []
        for k in range(seq):
            t = time.perf_counter()
            await rc.generate(f"a{k}", max_tokens=4, timeout=10)
            lat.append((time.perf_counter() - t) * 1000)
        conc: list[float] = []

        async def one(k: int) -> None:
            t = time.perf_counter()
            await rc.generate(f"ac{k}", max_tokens=4, timeout=60)
            conc.append((time.perf_counter() - t) * 1000)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(k) for k in range(300)))
        wall = time.perf_counter() - t0
    return {"async_p50": pct(lat, 50), "async_p99": pct(lat, 99), "async_conc_p50": pct(conc, 50),
            "async_conc_p99": pct(conc, 99), "async_conc_wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fleets", default="20,200")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--wakes", type=int, default=15, help="wake-ups measured per fleet (the median is reported)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="seconds for a fleet to register before measuring")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--idle-goal", action="store_true",
                    help="issue 36's figures: commands and Redis CPU per idle worker")
    ap.add_argument("--repeats", type=int, default=3, help="runs per fleet (--idle-goal, --sharded)")
    ap.add_argument("--sharded", action="store_true",
                    help="issue 36's idle figures on a model sharded over a Redis Cluster of each --masters")
    ap.add_argument("--masters", type=int, nargs="+", default=[3, 6], help="cluster sizes (--sharded)")
    ap.add_argument("--requests-only", action="store_true",
                    help="only the request path (sync and async clients), printed, RESULTS.md untouched")
    args = ap.parse_args()
    if args.requests_only:
        with EmbeddedRedis() as srv:
            print(json.dumps({k: round(v, 3) for k, v in requests(srv.url, args.requests).items()}))
        return
    if args.sharded:
        sharded_main(args)
        return
    if args.idle_goal:
        idle_goal_main(args)
        return
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
            f"{q['permits_back']} of 64 permits back after. The same through `AsyncRequestClient` (one event "
            f"loop): sequential p50 {q['async_p50']:.2f} ms, p99 {q['async_p99']:.2f} ms; 300 concurrent "
            f"(asyncio.gather) p50 {q['async_conc_p50']:.1f} ms, p99 {q['async_conc_p99']:.1f} ms, "
            f"{q['async_conc_wall']:.2f} s for all.\n")
    print(body)
    if args.write_results:
        write_section("idle_fleet", body)


if __name__ == "__main__":
    main()
