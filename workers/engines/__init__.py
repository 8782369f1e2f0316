"""Engines the worker can drive; ``make_engine`` imports heavy ones only when chosen."""

from __future__ import annotations

from typing import Any

from .base import Engine, Finished


def make_engine(kind: str, **kw: Any) -> Engine:
    if kind == "sim":
        from .sim import SimEngine
        return SimEngine(**kw)
    if kind == "torch":
        from .torch_engine import TorchEngine
        return TorchEngine(**kw)
    if kind == "trtllm":
        from .trtllm import TrtllmEngine
        return TrtllmEngine(**kw)
    if kind == "vllm":
        from .vllm_engine import VllmEngine
        return VllmEngine(**kw)
    if kind == "openai":
        from .openai_engine import OpenAIEngine
        return OpenAIEngine(**kw)
    raise ValueError(f"engine: unknown engine {kind!r} (sim, torch, trtllm, vllm, openai)")


__all__ = ["Engine", "Finished", "make_engine"]
