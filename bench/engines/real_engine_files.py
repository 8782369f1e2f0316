"""The OpenAI batch files of the real-engine benchmark (bench/engines/real_engine.py), made from a seed.

* ``prefix``: chat lines over ``shapes`` system prompts of 500 to 1,500 tokens (the byte-level
  tokenizer of the random model: a character is a token), shuffled; outputs 8 to 32 tokens.
* ``unique``: chat lines with no system prompt and a user prompt of 500 to 1,500 tokens each, no
  two alike; outputs 8 to 32 tokens.
* ``mixed``: as ``prefix``, with a long tail of outputs: 30 % of lines take 4 to 160 tokens.
* ``prefix-sorted``: the ``prefix`` lines ordered by system prompt: what a user who grouped the file
  by hand would give vLLM's runner, the limit the conductor aims at.

Every line asks for greedy decoding (``temperature`` 0), so that each side does the same work: the
random model never stops early (workers/engines/random_model.py), an answer is ``max_tokens`` long.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega label rate score judge summarise extract classify translate").split()
KINDS = ("prefix", "unique", "mixed", "prefix-sorted")


def _text(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def _line(i: int, model: str, system: str | None, user: str, max_tokens: int) -> dict[str, object]:
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}}


def lines(kind: str, n: int, model: str, shapes: int = 24, seed: int = 7) -> list[dict[str, object]]:
    if kind not in KINDS:
        raise ValueError(f"kind: one of {', '.join(KINDS)}, not {kind!r}")
    rng = random.Random(seed)
    if kind == "unique":
        return [_line(i, model, None, f"{i}: " + _text(rng, rng.randint(500, 1500)), rng.randint(8, 32))
                for i in range(n)]
    systems = [f"You are grader {k}. " + _text(rng, rng.randint(500, 1500)) for k in range(shapes)]
    out = []
    for i in range(n):
        k = rng.randrange(shapes)
        longest = 160 if kind == "mixed" else 32
        max_tokens = rng.randint(4, longest) if kind == "mixed" and rng.random() < 0.3 else rng.randint(8, 32)
        out.append((k, _line(i, model, systems[k], f"item {i}: " + _text(rng, rng.randint(10, 60)), max_tokens)))
    if kind == "prefix-sorted":
        out.sort(key=lambda kl: kl[0])
    return [ln for _, ln in out]


def write(path: Path, kind: str, n: int, model: str, shapes: int = 24, seed: int = 7) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines(kind, n, model, shapes, seed)))
    return path
