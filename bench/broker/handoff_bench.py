"""Same-host handoff (seed 001, issue 16) against direct claims: N sim GPU processes that each claim
for themselves (`conductor worker`), or one `conductor agent --gpus N` that claims for them and hands
batches over shared-memory rings.

    .venv/bin/python bench/broker/handoff_bench.py [--gpus 4] [--items 2000] [--write-results]

Per run: Redis connections (the most seen by CLIENT LIST, sampled every 50 ms, the benchmark's own
left out), Redis commands (INFO commandstats from start to the last process's exit, with the
commands the scripts run inside Redis; the sampling's CLIENT and INFO calls left out) per GPU and
per second per GPU, and claim-to-engine latency: from the start of the claim that got a batch to
the batch's admit into its engine (for the agent, across the ring: claim, encode, ring write,
wake-up, read, decode). Every process exits after 0.5 s idle; that tail is in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.report import command_line, machine, now_utc, table, write_section  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis, child_tie  # noqa: E402
from conductor.formats.native import from_native  # noqa: E402

QUICK = {"quiet_ms": 50, "release_batches": 0, "activate_batches": 0}
MODEL = "m"


def engine_flags(a: argparse.Namespace) -> list[str]:
    return ["--model", MODEL, "--max-batch-size", str(a.batch), "--sim-time-scale", str(a.time_scale)]


def direct_worker(url: str, name: str, batch: int, time_scale: float) -> None:
    """One direct worker (a subprocess of the benchmark), instrumented for claim-to-engine."""
    from conductor.redis_contract.records import Batch, BatchItem, Contract
    from conductor.workers.engines.base import Finished
    from conductor.workers.engines.sim import SimEngine
    from conductor.workers.worker import Worker, WorkerOptions

    lat: list[float] = []

    class Timed(Conductor):
        start = 0.0

        def claim(self, contract: Contract, consumer: str) -> Any:
            self.start = time.monotonic()
            return super().claim(contract, consumer)

    class TimedSim(SimEngine):
        def admit(self, b: Batch, items: list[BatchItem]) -> list[Finished]:
            lat.append((time.monotonic() - c.start) * 1000)
            return super().admit(b, items)

    c = Timed(connect(url))
    w = Worker(c, TimedSim(MODEL, max_batch_size=batch, time_scale=time_scale),
               WorkerOptions(name=name, idle_exit_s=0.5, heartbeat_ttl_s=10.0))
    w.run()
    print(json.dumps({"claim_to_engine_ms": lat}))


def submit(c: Conductor, n: int, job: str) -> None:
    c.ensure_model(MODEL)
    c.set_config(MODEL, QUICK)
    items = [from_native({"id": f"i{k}", "model": MODEL, "prompt": "p" * (20 + k % 7),
                          "max_tokens": 16}) for k in range(n)]
    c.submit(items, job, seal=True)


class Sampler:
    """Peak connections of the processes under test (CLIENT LIST less the sampler's own)."""

    def __init__(self, r: Any) -> None:
        self.r, self.peak, self.stop = r, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, len(self.r.client_list()) - 1)


def commands(r: Any) -> int:
    stats = r.info("commandstats")
    return sum(v["calls"] for k, v in stats.items()
               if not k.startswith(("cmdstat_client", "cmdstat_info", "cmdstat_config")))


def run_mode(url: str, a: argparse.Namespace, mode: str, depth: int = 0) -> dict[str, Any]:
    r = connect(url)
    r.flushall()
    c = Conductor(r)
    submit(c, a.items, "j")
    r.config_resetstat()
    sampler = Sampler(connect(url))
    sampler.thread.start()
    t0 = time.monotonic()
    if mode == "direct":
        procs = [subprocess.Popen([sys.executable, __file__, "--direct-worker", url, f"w{i}", str(a.batch),
                                   str(a.time_scale)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  preexec_fn=child_tie())
                 for i in range(a.gpus)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        lat = [x for o in outs for x in json.loads(o.splitlines()[-1])["claim_to_engine_ms"]]
        p50 = statistics.median(lat)
    else:
        p = subprocess.run([sys.executable, "-m", "conductor", "--redis", url, "agent", *engine_flags(a),
                            "--gpus", str(a.gpus), "--depth", str(depth), "--idle-exit", "0.5", "--name", "ag"],
                           capture_output=True, timeout=600, text=True)
        stopped = [json.loads(x) for x in p.stderr.splitlines() if '"agent_stopped"' in x]
        if p.returncode or not stopped:
            raise SystemExit(f"agent failed: {p.stderr[-2000:]}")
        p50 = stopped[-1]["claim_to_engine_ms_p50"]
    wall = time.monotonic() - t0
    sampler.stop.set()
    sampler.thread.join()
    n_cmd = commands(r)
    st = c.status("j")
    assert st["completed"] == a.items and st["pending"] == 0, st
    return {"mode": mode if mode == "direct" else f"agent, depth {depth}", "wall": wall, "conns": sampler.peak,
            "cmds": n_cmd, "p50": p50}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--direct-worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.direct_worker:
        url, name, batch, ts = a.direct_worker
        direct_worker(url, name, int(batch), float(ts))
        return
    srv = EmbeddedRedis().start()
    try:
        where = machine(connect(srv.url))
        runs = [run_mode(srv.url, a, "direct"), run_mode(srv.url, a, "agent", 1), run_mode(srv.url, a, "agent", 2)]
    finally:
        srv.close()
    n = a.gpus
    rows = [[x["mode"], x["conns"], f"{x['conns'] / n:.2f}", x["cmds"], f"{x['cmds'] / n:.0f}",
             f"{x['cmds'] / n / x['wall']:.0f}", f"{x['p50']:.3f}", f"{x['wall']:.2f}"] for x in runs]
    head = ["claims", "Redis connections (peak)", "per GPU", "Redis commands", "per GPU", "per GPU per s",
            "claim-to-engine ms (median)", "wall s"]
    body = (f"## Same-host handoff against direct claims (issue 16, seed 001)\n\n"
            f"Command: `{command_line()}`  \nRun: {now_utc()}; {where}.  \n"
            f"{a.items} items (16 output tokens each) in batches of {a.batch}, {n} sim GPU processes at time "
            f"scale {a.time_scale:g}; every process exits after 0.5 s idle (in the figures). Commands: INFO "
            f"commandstats, with the commands scripts run inside Redis.\n\n" + table(head, rows))
    print(body)
    if a.write_results:
        write_section("handoff", body)


if __name__ == "__main__":
    main()
