"""The fairness bench's shares scenarios over several seeds: the largest service gap and A's share per
seed, and their medians, for one engine size (bench/fleet/fairness.py says what the figures are).

    .venv/bin/python bench/fleet/fairness_seeds.py --engine-seqs 64 --seeds 5
    .venv/bin/python bench/fleet/fairness_seeds.py --engine-seqs 1024 --seeds 5

One seed's gap moves by several batches with small changes in the claim order, so a change to fair share
is judged on the median over seeds (seed k: the workloads' seeds 11 + 100k and 12 + 100k; k = 0 is the
fairness bench's own). Prints only."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.fleet import fairness as F  # noqa: E402
from conductor.client import connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-seqs", type=int, default=F.ENGINE_SEQS)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--items", type=int, default=20_000)
    a = p.parse_args(argv)
    F.ENGINE_SEQS = a.engine_seqs
    with EmbeddedRedis() as srv:
        r = connect(srv.url)
        for wa in (1.0, 3.0):
            gaps, shares = [], []
            for k in range(a.seeds):
                n = a.items
                jobs = [F.JobSpec("a-big", F._spec(11 + 100 * k, n * 9 // 10, 12), tenant="A"),
                        F.JobSpec("b-small", F._spec(12 + 100 * k, n // 10, 4), tenant="B")]
                weights = {"A": wa, "B": 1.0}
                s = F.shares(F.run(r, srv.url, jobs, 2, weights), weights)
                gaps.append(s["gap_batches"])
                shares.append(s["share"])
            print(f"engine {a.engine_seqs}, weights {wa:g}:1: gap per seed "
                  f"{', '.join(f'{g:.2f}' for g in gaps)}; median {statistics.median(gaps):.2f} batches; "
                  f"A's share median {100 * statistics.median(shares):.1f}% (goal {100 * wa / (wa + 1):.0f}%)",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
