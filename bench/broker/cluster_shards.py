"""One model sharded over the masters of a Redis Cluster (issue 36): each master's share of the work.

    .venv/bin/python bench/broker/cluster_shards.py [--items 20000] [--masters 3 6] [--shapes 48 480]
                                                    [--workers 4] [--no-write]

For each cluster size (``redis-server --cluster-enabled yes`` per master on free ports, joined with
``redis-cli --cluster create``) and each shape count: one model with ``shards`` = 1 and = the
masters, ``--items`` items submitted through the library and drained by ``--workers`` sim worker
processes (``--sim-time-scale 0``). Per master: its CPU time over the run (INFO cpu, used_cpu_sys +
used_cpu_user, less its idle rate measured before the run times the run's length: the cluster bus
and cron) and its commands (INFO commandstats), per item. The busiest master's share of the CPU is
the figure the issue asks for (goal: at most 1.2/S). Shapes are placed by the least loaded shard at
their first submit (conductor/client/shard_route.py); ``hash`` rows record XXH64(signature) mod S
instead, before the submit, for the comparison. Rewrites its section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis  # noqa: E402

from bench.common.report import command_line, machine, now_utc, publish, table  # noqa: E402
from bench.common.workload import make_items  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import child_tie  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402
from conductor.redis_contract import shards as S  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SECTION = "cluster-shards"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class Cluster:
    """``masters`` redis-server processes in cluster mode, joined by redis-cli --cluster create."""

    def __init__(self, masters: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="cdr-shards-")
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start(masters)
        except BaseException:
            self.close()  # a start that failed halfway leaves no server running (nothing else would stop it)
            raise

    def _start(self, masters: int) -> None:
        for i in range(masters):
            d = Path(self.dir) / str(i)
            d.mkdir()
            # a free port can be taken (its own or its bus port, +10000) before the server binds it, by
            # another process of a busy machine: that server exits, and the next port is tried
            for _ in range(5):
                port = _free_port()
                while port + 10000 > 65535 or port in self.ports:
                    port = _free_port()
                proc = subprocess.Popen(
                    ["redis-server", "--port", str(port), "--cluster-enabled", "yes", "--cluster-config-file",
                     str(d / "nodes.conf"), "--dir", str(d), "--save", "", "--appendonly", "no", "--bind",
                     "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=child_tie())
                self.procs.append(proc)
                if _wait_ping(port, proc):
                    break
            else:
                raise RuntimeError("no redis-server of the cluster started on a free port in 5 tries")
            self.ports.append(port)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(b"cluster_state:ok" in redis.Redis(port=p).execute_command("CLUSTER", "INFO") for p in self.ports):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster never reached state ok")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0?cluster=1"

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _wait_ping(port: int, proc: subprocess.Popen[bytes]) -> bool:
    """True once ``proc`` answers on ``port``; False when it exited first (its port was taken, maybe by
    another redis-server: the one that answers must be ``proc``)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if redis.Redis(port=port).info("server")["process_id"] == proc.pid:
                return True
            time.sleep(0.05)
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on {port} never answered")


def _cpu_calls(port: int) -> tuple[float, int]:
    r = redis.Redis(port=port)
    cpu = r.info("cpu")
    calls = sum(int(v["calls"]) for v in r.info("commandstats").values())
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), calls


def run_one(cl: Cluster, model: str, shards: int, shapes: int, items: int, workers: int, placement: str) -> dict:
    c = Conductor(connect(cl.url))
    c.set_config(model, {"shards": shards, "quiet_ms": 200})
    its = [it.__class__(id=it.id, model=model, sig=it.sig, input_tokens=it.input_tokens, max_tokens=it.max_tokens,
                        body=it.body, prefix=it.prefix)
           for it in make_items(items, shapes=shapes, seed=3, tag=model, mu=4.6, sigma=0.4)]
    if placement == "hash" and shards > 1:
        sigs = {it.sig for it in its}
        c.r.hset(K.ModelKeys(model).shard_of, mapping={s: S.shard_index(s, shards) for s in sigs})
    idle0 = [_cpu_calls(p) for p in cl.ports]
    time.sleep(2.0)
    idle1 = [_cpu_calls(p) for p in cl.ports]
    idle_rate = [(b[0] - a[0]) / 2.0 for a, b in zip(idle0, idle1, strict=True)]
    t0 = time.monotonic()
    job = f"j-{model}"
    c.submit(its, job, seal=True)
    env = dict(os.environ, CONDUCTOR_REDIS_URL=cl.url)
    procs = [subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                               "--sim-time-scale", "0", "--model", model, "--name", f"w{i}", "--max-batch-size", "64",
                               "--max-batch-tokens", "65536", "--max-input-len", "8192"],
                              env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, preexec_fn=child_tie())
             for i in range(workers)]
    try:
        deadline = time.monotonic() + 600
        while not c.status(job)["done"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job} not done in 600 s: {c.status(job)}")
            time.sleep(0.25)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    took = time.monotonic() - t0
    end = [_cpu_calls(p) for p in cl.ports]
    cpu = [max(0.0, e[0] - b[0] - rate * (took + 2.0)) for e, b, rate in zip(end, idle1, idle_rate, strict=True)]
    calls = [e[1] - b[1] for e, b in zip(end, idle1, strict=True)]
    total = sum(cpu) or 1e-9
    per_shard = {n: int(c.status(job)["models"].get(n, {}).get("submitted", 0)) for n in c.shards(model)}
    return {"masters": len(cl.ports), "shards": shards, "shapes": shapes, "placement": placement, "items": items,
            "took_s": took, "cpu_us_item": [x / items * 1e6 for x in cpu], "calls_item": [x / items for x in calls],
            "share": max(cpu) / total, "items_per_shard": sorted(per_shard.values(), reverse=True)}


def idle_rate(cl: Cluster, model: str, shards: int, seconds: float) -> tuple[float, float]:
    """One idle worker (sim, doorbell wake) on a model with nothing waiting: the commands a second it
    costs all the masters together, and their CPU us a second, past its first seconds (registration)."""
    c = Conductor(connect(cl.url))
    c.set_config(model, {"shards": shards})
    env = dict(os.environ, CONDUCTOR_REDIS_URL=cl.url)
    p = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                          "--model", model, "--name", "idle"], env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL,
                         preexec_fn=child_tie())
    try:
        time.sleep(4.0)
        before = [_cpu_calls(port) for port in cl.ports]
        quiet0 = time.monotonic()
        time.sleep(seconds)
        after = [_cpu_calls(port) for port in cl.ports]
        took = time.monotonic() - quiet0
    finally:
        p.terminate()
        p.wait(30)
    calls = sum(a[1] - b[1] for a, b in zip(after, before, strict=True)) - 2 * len(cl.ports)  # INFO's own
    cpu = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    return calls / took, cpu / took * 1e6


def on_paper(data: list[dict]) -> str:
    """Items a second one model's Redis carries, from the figures above: the busiest master saturates
    first, at one core; against fleets of GPUs at 10 to 25 items a second each."""
    rows = []
    for d in data:
        busiest = max(d["cpu_us_item"])  # us of the busiest master's CPU per item of the whole job
        cap = 1e6 / busiest if busiest else 0.0
        rows.append((d["masters"], d["shards"], d["shapes"], d["placement"], f"{busiest:.0f}", f"{cap:,.0f}",
                     f"{cap / 25:,.0f} to {cap / 10:,.0f}"))
    return ("On paper, from the rows above: one model's items a second when its busiest master's core is "
            "saturated (1e6 / that master's CPU us per item), and the GPUs that rate feeds at 10 to 25 items a "
            "second each. Only the Redis side: the workers' own CPU, the network and the producer are not in it; "
            "shared cores here (see the machine line) make the absolute figures pessimistic.\n\n"
            + table(["masters", "shards", "shapes", "placement", "busiest master us/item", "items/s, one model",
                     "GPUs fed (25 to 10 items/s each)"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--masters", type=int, nargs="+", default=[3, 6])
    p.add_argument("--shapes", type=int, nargs="+", default=[48, 480])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--idle-s", type=float, default=10.0, help="how long an idle worker is measured (0: not)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    rows, data, idle = [], [], []
    for masters in a.masters:
        cl = Cluster(masters)
        try:
            if a.idle_s > 0:
                for shards in (1, masters):
                    got_idle = idle_rate(cl, f"idle{shards}", shards, a.idle_s)
                    idle.append((masters, shards, f"{got_idle[0]:.1f}", f"{got_idle[1]:.0f}"))
                    print(idle[-1], flush=True)
            n = 0
            for shapes in a.shapes:
                for shards, placement in ((1, "-"), (masters, "hash"), (masters, "least loaded")):
                    n += 1
                    got = run_one(cl, f"m{n}", shards, shapes, a.items, a.workers, placement)
                    data.append(got)
                    rows.append((masters, shards, shapes, placement, f"{got['took_s']:.1f}",
                                 " / ".join(f"{x:.0f}" for x in got["cpu_us_item"]),
                                 f"{sum(got['cpu_us_item']):.0f}",
                                 " / ".join(f"{x:.1f}" for x in got["calls_item"]),
                                 f"{got['share']:.2f}", f"{1.2 / shards:.2f}",
                                 " / ".join(str(x) for x in got["items_per_shard"])))
                    print(rows[-1], flush=True)
        finally:
            cl.close()
    text = (f"## One model sharded over a Redis Cluster (issue 36)\n\n`{command_line()}`, {now_utc()}; "
            f"{machine()}.\n\n"
            f"{a.items} items of one model, submitted through the library and drained by {a.workers} sim worker "
            "processes (`--sim-time-scale 0`); shards = 1 (today's layout: one master) and shards = the masters. "
            "CPU: each master's INFO cpu over the run, less its idle rate (cluster bus, cron) measured for 2 s "
            "before; commands: INFO commandstats. Share: the busiest master's part of the CPU (goal: at most "
            "1.2/S). Placement: `hash` records XXH64(signature) mod S for every shape before the submit; `least "
            "loaded` is what the client does (each new shape to the shard with the fewest waiting tokens, "
            "recorded).\n\n"
            + table(["masters", "shards", "shapes", "placement", "run s", "CPU us/item per master", "CPU us/item",
                     "commands/item per master", "busiest share", "goal", "items per shard"], rows))
    if idle:
        text += ("\n\nOne idle worker (sim, doorbell wake, default heartbeat TTL 10 s) on a model with nothing "
                 f"waiting, over {a.idle_s:g} s after its first 4: the commands a second and the CPU us a second of "
                 "all "
                 "the masters together (cluster bus and cron included), unsharded and over every master.\n\n"
                 + table(["masters", "shards", "commands/s", "CPU us/s, all masters"], idle))
    text += "\n\n" + on_paper(data)
    publish(text, SECTION, write=not a.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
