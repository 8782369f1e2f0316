"""Claim latency with many busy workers against one (issue 16's figure: claim p99 with 16 busy
workers at most 2x that with 1).

    .venv/bin/python bench/broker/claim_contention.py [--workers 1,16] [--items 20000] [--write-results]

Each worker is a process of its own (one connection, claim then complete in a loop, no engine:
what a fleet does to Redis when its GPUs are fast). Two figures per fleet size, from the same run:
the claim's round trip as the workers measure it (client side: includes waiting for Redis and for
a CPU of this machine), and the claim script's own time inside Redis (SLOWLOG at threshold 0:
what one claim costs Redis while the others queue). Each run uses a fresh embedded redis-server
and the same seeded backlog.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.report import command_line, machine, median, now_utc, pct, table, write_section  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.formats.native import from_native  # noqa: E402
from conductor.redis_contract.records import Contract  # noqa: E402
from tests.helpers import results_for  # noqa: E402

MODEL = "bench"
C = Contract(model=MODEL, max_batch_size=16, max_batch_tokens=8192, max_input_len=4096)


def _worker(url: str, name: str, start: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    c = Conductor.from_url(url)
    times: list[float] = []
    while time.time() < start:
        time.sleep(0.001)
    while True:
        t = time.perf_counter()
        b, why = c.claim(C, name)
        if b is None:
            if why == "idle":
                break
            continue
        times.append((time.perf_counter() - t) * 1000)
        c.complete(b, results_for(b, name))
    out.put(times)


def run(n: int, items: int) -> dict[str, float]:
    srv = EmbeddedRedis().start()
    try:
        c = Conductor(connect(srv.url))
        c.set_config(MODEL, {"quiet_ms": 50, "release_batches": 0, "activate_batches": 0})
        c.submit([from_native({"id": str(i), "model": MODEL, "prefix": [f"s{i % 8}"], "prompt": "p",
                               "input_tokens": 20 + (i * 37) % 400, "max_tokens": 8}) for i in range(items)],
                 "j", seal=True)
        c.r.config_set("slowlog-log-slower-than", 0)
        c.r.config_set("slowlog-max-len", 200_000)
        c.r.slowlog_reset()
        q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        start = time.time() + 0.5
        procs = [mp.Process(target=_worker, args=(srv.url, f"w{k}", start, q)) for k in range(n)]
        for p in procs:
            p.start()
        client = [x for _ in procs for x in q.get(timeout=600)]
        for p in procs:
            p.join()
        wall = time.time() - start
        server = [e["duration"] / 1000 for e in c.r.slowlog_get(200_000)
                  if e["command"].startswith(b"EVALSHA") and e["command"].count(b" ") > 8
                  and b":batches" in e["command"] and b":reclaimed" in e["command"]]
        assert c.status("j")["pending"] == 0
        return {"claims": len(client), "p50": median(client), "p99": pct(client, 99),
                "s50": median(server), "s99": pct(server, 99), "n_server": len(server), "wall": wall}
    finally:
        srv.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,16")
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    sizes = [int(x) for x in args.workers.split(",")]
    res = {n: run(n, args.items) for n in sizes}
    for n, f in res.items():
        print(n, f, flush=True)
    base = res[sizes[0]]
    rows = [[n, f["claims"], f"{f['p50']:.2f}", f"{f['p99']:.2f}", f"{f['p99'] / base['p99']:.2f}x",
             f"{f['s50']:.3f}", f"{f['s99']:.3f}", f"{f['s99'] / base['s99']:.2f}x", f"{f['wall']:.1f}"]
            for n, f in res.items()]
    body = (f"## Claim latency, busy fleet against one worker (issue 16)\n\nCommand: `{command_line()}`  \n"
            f"Run: {now_utc()}; {machine()}.  \nWorkers are processes (claim, complete, repeat; no engine) on "
            f"{args.items} items of 8 shapes; claim batches of up to 16. Client: the claim's round trip in "
            f"the worker. Server: the claim script's time inside Redis (SLOWLOG, threshold 0).\n\n"
            + table(["workers", "claims", "client p50 ms", "client p99 ms", "client p99 vs 1",
                     "server p50 ms", "server p99 ms", "server p99 vs 1", "wall s"], rows) + "\n")
    print(body)
    if args.write_results:
        write_section("claim_contention", body)


if __name__ == "__main__":
    main()
