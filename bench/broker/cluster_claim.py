"""Claim round trip on a three-node Redis Cluster against a single node, same items, same run.

    .venv/bin/python bench/broker/cluster_claim.py [--claims 400]

A check that the cluster path (a cluster client; the claim's own connection to the node owning
the model's slot, found per call) costs nothing measurable: 64-item batches from a 40,000-item
single-shape backlog, the single node measured before and after the cluster. Prints only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.report import median  # noqa: E402
from bench.common.workload import make_items  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedCluster, EmbeddedRedis  # noqa: E402
from conductor.redis_contract.records import (
    Contract,  # noqa: E402
    PreparedItem,  # noqa: E402
)

MODEL = "kilo"


def claims(url: str, n: int) -> list[float]:
    c = Conductor(connect(url))
    c.set_config(MODEL, {"release_batches": 0, "activate_batches": 0, "quiet_ms": 0})
    items = [PreparedItem(id=it.id, model=MODEL, sig=it.sig, input_tokens=it.input_tokens,
                          max_tokens=it.max_tokens, body=it.body, prefix=it.prefix)
             for it in make_items(40_000, shapes=1, seed=2, tag="c", mu=4.6, sigma=0.25)]
    c.submit(items, "b")
    contract = Contract(model=MODEL, max_batch_size=64, max_batch_tokens=65536, max_input_len=8192)
    for _ in range(20):
        c.claim(contract, "w")
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        b, why = c.claim(contract, "w")
        out.append((time.perf_counter_ns() - t) / 1000)
        if b is None:
            raise RuntimeError(f"backlog ran dry: {why}")
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--claims", type=int, default=400)
    a = p.parse_args(argv)
    rows = []
    for name, server in (("single node", EmbeddedRedis), ("3-node cluster", lambda: EmbeddedCluster(3)),
                         ("single node, again", EmbeddedRedis)):
        with server() as srv:
            ts = claims(srv.url, a.claims)
        rows.append((name, median(ts), ts[int(len(ts) * 0.99)]))
    print("| server | claim p50 us | claim p99 us |\n|---|---|---|")
    for name, p50, p99 in rows:
        print(f"| {name} | {p50:.0f} | {p99:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
