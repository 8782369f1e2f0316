"""A seeded, reproducible batch-inference workload (issue 6, part 1).

* Shapes: ``shapes`` cacheable prefixes (a system prompt plus a few-shot block) of 200 to
  3,000 tokens each (uniform), with Zipf popularity (weight of the shape of rank r is r^-s).
  Prefix text is 4 bytes per token, so ``conductor.formats.lines.estimate_tokens`` (what the sim
  engine uses to price a prefix) gives back the intended count.
* Input length of an item: its shape's prefix tokens plus a lognormal suffix (``suffix_mu``,
  ``suffix_sigma``, in log tokens), capped at ``max_suffix``.
* Output limit: one per shape, drawn from ``output_limits``.
* Arrival: ``backlog`` (everything at time 0) or ``trickle`` (item i arrives at i / rate
  simulated seconds).

The same seed gives the same items, ids and order in any process.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, field

from conductor.formats.lines import parse_line
from conductor.formats.signature import shape_signature
from conductor.redis_contract.records import PreparedItem, json_encoder

_WORDS = ("the model reads each record and answers in the house style with a short label and a reason "
          "given below as examples of good and bad answers for this task").split()


@dataclass(frozen=True)
class Shape:
    rank: int
    prefix: tuple[str, ...]
    prefix_tokens: int
    max_tokens: int
    sig: str


@dataclass
class WorkloadSpec:
    items: int = 10_000
    shapes: int = 50
    zipf_s: float = 1.1
    prefix_min: int = 200
    prefix_max: int = 3000
    suffix_mu: float = math.log(120)
    suffix_sigma: float = 0.7
    max_suffix: int = 2000
    output_limits: tuple[int, ...] = (16, 32, 64, 128)
    arrival: str = "backlog"
    rate: float = 2000.0  # items per simulated second, trickle only
    seed: int = 7
    model: str = "bench-sim"


@dataclass
class Workload:
    spec: WorkloadSpec
    shapes: list[Shape]
    items: list[PreparedItem]
    arrival_s: list[float] = field(default_factory=list)  # simulated arrival time per item

    @property
    def by_sig(self) -> dict[str, Shape]:
        return {s.sig: s for s in self.shapes}


def _text(rng: random.Random, tokens: int) -> str:
    out: list[str] = []
    size = 0
    target = 4 * tokens
    while size < target:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:target].ljust(target, ".")


def make_shapes(spec: WorkloadSpec, rng: random.Random) -> list[Shape]:
    shapes = []
    for rank in range(1, spec.shapes + 1):
        total = rng.randint(spec.prefix_min, spec.prefix_max)
        system = max(50, total // 3)
        few_shot = total - system
        prefix = (f"[shape {rank}] " + _text(rng, system)[len(f"[shape {rank}] "):], _text(rng, few_shot))
        shapes.append(Shape(rank=rank, prefix=prefix, prefix_tokens=total,
                            max_tokens=rng.choice(spec.output_limits), sig=shape_signature(prefix)))
    return shapes


def generate(spec: WorkloadSpec) -> Workload:
    if spec.arrival not in ("backlog", "trickle"):
        raise ValueError(f"arrival must be 'backlog' or 'trickle', got {spec.arrival!r}")
    rng = random.Random(spec.seed)
    shapes = make_shapes(spec, rng)
    weights = [r ** -spec.zipf_s for r in range(1, spec.shapes + 1)]
    picks = rng.choices(range(spec.shapes), weights=weights, k=spec.items)
    items = []
    for i, s in enumerate(picks):
        sh = shapes[s]
        suffix = max(1, min(spec.max_suffix, round(rng.lognormvariate(spec.suffix_mu, spec.suffix_sigma))))
        prompt = f"record {i}: " + "x" * min(200, suffix)
        items.append(PreparedItem(id=f"w{spec.seed}-{i:07d}", model=spec.model, sig=sh.sig,
                                  input_tokens=sh.prefix_tokens + suffix, max_tokens=sh.max_tokens,
                                  body=json_encoder.encode([prompt, None]), prefix=sh.prefix))
    arrival = [0.0] * len(items) if spec.arrival == "backlog" else [i / spec.rate for i in range(len(items))]
    return Workload(spec=spec, shapes=shapes, items=items, arrival_s=arrival)


PROMPT_BYTES = 280  # body = JSON [prompt, null]: about 290 bytes, plus id/job/tok/mt fields


def make_items(n: int, *, shapes: int, seed: int, tag: str, mu: float = 5.0, sigma: float = 0.5,
               model: str = "bench") -> list[PreparedItem]:
    """``n`` items of about 300 bytes over ``shapes`` shapes, lognormal input lengths: the small-item
    workload of the submit and claim benchmarks (bench/broker/submit_claim.py, its profiles, the disk tier's
    and the cluster claim's)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    prefixes = [[f"You are assistant number {s}. " + "Follow the house style. " * 8] for s in range(shapes)]
    out = []
    for i in range(n):
        prompt = "".join(rng.choice(alphabet) for _ in range(16)) * (PROMPT_BYTES // 16)
        tok = max(1, min(4000, int(rng.lognormvariate(mu, sigma))))
        out.append(parse_line(json.dumps({
            "id": f"{tag}-{i:07d}", "model": model, "prefix": prefixes[i % shapes], "prompt": prompt,
            "input_tokens": tok, "max_tokens": 64})))
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the workload as native JSON lines (for ``conductor submit`` / ``conductor run``)."""
    p = argparse.ArgumentParser(description="write a seeded workload as native JSON lines to stdout")
    p.add_argument("--items", type=int, default=10_000)
    p.add_argument("--shapes", type=int, default=50)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--model", default="bench-sim")
    a = p.parse_args(argv)
    wl = generate(WorkloadSpec(items=a.items, shapes=a.shapes, seed=a.seed, model=a.model))
    for it in wl.items:
        prompt, _ = json.loads(it.body)
        sys.stdout.write(json.dumps({"id": it.id, "model": it.model, "prefix": list(it.prefix), "prompt": prompt,
                                     "input_tokens": it.input_tokens, "max_tokens": it.max_tokens}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
