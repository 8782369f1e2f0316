"""Writes a deterministic demo input: N items over S shapes, lognormal prompt lengths.

    python examples/make_prompts.py -n 1000 -s 8 -o examples/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random


def make(n: int, shapes: int, seed: int = 7, model: str = "demo-7b") -> list[dict]:
    rng = random.Random(seed)
    systems = [f"You are assistant #{s}. " + " ".join(f"rule{s}-{k}" for k in range(20 + 12 * s))
               for s in range(shapes)]
    weights = [1 / (s + 1) for s in range(shapes)]
    out = []
    for i in range(n):
        s = rng.choices(range(shapes), weights)[0]
        words = max(4, int(rng.lognormvariate(4.0, 0.6)))
        prompt = " ".join(f"w{rng.randrange(1000)}" for _ in range(words))
        out.append({"id": f"item-{i:06d}", "model": model, "prefix": [systems[s], f"few-shot block {s}"],
                    "prompt": prompt, "max_tokens": rng.choice([16, 32, 64]), "payload": {"row": i}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("-s", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default="demo-7b")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    with open(a.output, "w") as f:
        for row in make(a.n, a.s, a.seed, a.model):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
