"""Shared set-up of the real-engine tests (vLLM in process, a real ``vllm serve``): a small random model
written to a folder, OpenAI batch lines, and the checks every such test ends with."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conductor.client import Conductor
from conductor.formats.lines import parse_line
from conductor.workers.engines.random_model import ModelSize, write_random_llama

# vLLM, torch and transformers warn at import and start about things this suite does not control
# (deprecations inside them, Triton missing on a CPU); the suite turns warnings into errors.
VLLM_WARNINGS = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
                 pytest.mark.filterwarnings("ignore::FutureWarning"),
                 pytest.mark.filterwarnings("ignore::UserWarning"),
                 pytest.mark.filterwarnings("ignore::ResourceWarning"),
                 pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
SMALL = ModelSize(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, max_positions=2048)
KV_BYTES = 32 << 20
# Every vLLM these tests start: quiet, not bound to one core (vLLM's automatic binding would put each
# engine on the same core as every other), and in the process that builds it (a start in 11 s, not 25);
# the tests of vLLM's own processes (a SIGKILLed worker, a dead engine core) ask for those.
VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


# The environment before any vLLM ran in this process: an engine built in process sets variables of its
# own in os.environ (ranks, thread settings) that a vLLM in a child process must not inherit.
_BASE_ENV = dict(os.environ)


def vllm_env() -> dict[str, str]:
    return dict(_BASE_ENV, **VLLM_ENV)


def write_model(tmp: Path) -> Path:
    return write_random_llama(tmp / "model", SMALL)


def chat_line(cid: str, system: str | None, user: str, max_tokens: int = 8, model: str = "tiny",
              **options: Any) -> dict[str, Any]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": msgs, "max_tokens": max_tokens, **options}}


def shaped_lines(n: int, shapes: int = 3, max_tokens: int = 8, model: str = "tiny") -> list[dict[str, Any]]:
    systems = [f"system prompt {k}: " + "grade the answer carefully. " * 12 for k in range(shapes)]
    return [chat_line(f"r{i}", systems[i % shapes], f"question {i}", max_tokens, model, temperature=0)
            for i in range(n)]


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def submit_lines(c: Conductor, job: str, lines: list[dict[str, Any]]) -> None:
    c.submit([parse_line(json.dumps(x)) for x in lines], job, seal=True)


def answers(c: Conductor, job: str) -> dict[str, list[dict[str, Any]]]:
    """Every result record of ``job`` by item id (a list: an id answered twice shows as two)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in c.results(job):
        row = json.loads(rec)
        out.setdefault(row["id"], []).append(row)
    return out


def assert_each_once(c: Conductor, job: str, ids: list[str], errors: dict[str, str] | None = None) -> None:
    """Every id answered exactly once, without an error unless ``errors`` names its code."""
    got = answers(c, job)
    missing, extra = sorted(set(ids) - set(got)), sorted(set(got) - set(ids))
    assert not missing and not extra, f"missing {missing[:5]}, extra {extra[:5]}"
    twice = [i for i, rows in got.items() if len(rows) != 1]
    assert not twice, f"answered more than once: {twice[:5]}"
    for i, (row,) in got.items():
        want = (errors or {}).get(i)
        assert (row["error"] or {}).get("code") == want, (i, row["error"])
        if want is None:
            assert row["output_tokens"] > 0 and row["output"], row
