"""``trtllm``: TensorRT-LLM's LLM API (target 1.2.x) under the continuous-batching protocol.

TensorRT-LLM batches in flight by itself: every admitted item becomes one ``generate_async``
request and its executor schedules them. So with this engine the conductor's token budget
decides admission and grouping (which items, from which shape, arrive together) and the
latch decides how many are alive; the engine does the packing. ``step`` collects the
requests that finished, waiting a few milliseconds when none has.

* ``SamplingParams(max_tokens=...)`` is always set from the item: its default is 32 tokens,
  which would silently cut every longer answer. A request's options (``temperature``, ``top_p``,
  ``seed``, ``stop``: conductor/formats/openai_options.py ``request_options``) go into it as given.
* ``KvCacheConfig(enable_block_reuse=True)``: KV blocks of a prompt prefix already seen are
  reused, which is where a batch of one shape saves its shared prefix.
* The prompt is built as in the torch engine: ``"\\n".join(prefix) + "\\n" + prompt``.

The package is imported only when this engine is chosen; without it the worker stops at
start with one line saying what to install.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conductor.formats.openai_options import request_options
from conductor.redis_contract.records import Batch, BatchItem, Contract, ResultError

from .base import ContractHolder, EngineConfigError, EngineUnavailable, Finished, too_long

INSTALL_HINT = ("engine trtllm needs TensorRT-LLM, which is not installed here: on a machine with an NVIDIA GPU "
                "and CUDA, pip install 'tensorrt-llm==1.2.*' (or use --engine torch / --engine sim)")


def _import() -> tuple[Any, Any, Any]:
    try:
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig
    except ImportError as e:
        raise EngineUnavailable(f"{INSTALL_HINT} ({e})") from None
    return LLM, SamplingParams, KvCacheConfig


class TrtllmEngine(ContractHolder):
    kind = "trtllm"

    def __init__(self, model: str, *, model_path: str | None = None, max_batch_size: int = 64,
                 max_batch_tokens: int = 8192, max_input_len: int = 4096, max_seq_len: int | None = None,
                 kv_cache_fraction: float = 0.9, poll_s: float = 0.002) -> None:
        LLM, self._SamplingParams, KvCacheConfig = _import()
        if not model_path:
            raise EngineConfigError("--model-path: the trtllm engine needs a local model folder (checkpoint or engine)")
        if not Path(model_path).is_dir():
            raise EngineConfigError(f"--model-path: {model_path!r} is not a folder")
        self.llm = LLM(model=model_path, max_batch_size=max_batch_size, max_num_tokens=max_batch_tokens,
                       max_input_len=max_input_len, max_seq_len=max_seq_len,
                       kv_cache_config=KvCacheConfig(enable_block_reuse=True,
                                                     free_gpu_memory_fraction=kv_cache_fraction))
        self.tokenizer = self.llm.tokenizer
        self._contract = Contract(model=model, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                  max_input_len=max_input_len)
        self.poll_s = poll_s
        self._pending: list[tuple[Batch, BatchItem, Any]] = []
        self._shutdown = getattr(self.llm, "shutdown", None)

    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        limit = self._contract.max_input_len
        head = "\n".join(batch.prefix) + "\n" if batch.prefix else ""
        refused = []
        for it in items:
            ids = self.tokenizer.encode(head + it.prompt)
            if it.input_tokens > limit:
                refused.append(too_long(batch, it, limit))
            elif len(ids) > limit:
                refused.append(Finished(batch, it, "", 0, ResultError(
                    "input_too_long", f"prompt is {len(ids)} tokens for this model's tokenizer; "
                    f"this engine takes max_input_len {limit}")))
            else:
                opts = {k: v for k, v in request_options(it.payload).items()
                        if k in ("temperature", "top_p", "seed", "stop")}
                params = self._SamplingParams(max_tokens=it.max_tokens, **opts)
                self._pending.append((batch, it, self.llm.generate_async(ids, sampling_params=params)))
        return refused

    def _collect(self) -> list[Finished]:
        done, left = [], []
        for batch, it, fut in self._pending:
            if not getattr(fut, "finished", False):
                left.append((batch, it, fut))
                continue
            try:
                out = fut.result().outputs[0]
                done.append(Finished(batch, it, out.text, len(out.token_ids)))
            except Exception as e:  # noqa: BLE001 - one request's failure is that item's error result
                done.append(Finished(batch, it, "", 0, ResultError("engine_error", f"trtllm: {e!r}"[:2000])))
        self._pending = left
        return done

    def step(self) -> list[Finished]:
        if not self._pending:
            return []
        done = self._collect()
        if not done:
            time.sleep(self.poll_s)  # the executor decodes on its own threads; do not spin on the GIL
            done = self._collect()
        return done

    def active(self) -> int:
        return len(self._pending)

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        """TensorRT-LLM captures its CUDA graphs when the LLM is built; nothing to do per shape."""

    def close(self) -> None:
        for _, _, fut in self._pending:
            abort = getattr(fut, "abort", None)
            if abort is not None:
                abort()
        self._pending.clear()
        shutdown, self._shutdown = self._shutdown, None  # idempotent: the worker and a test may both close
        if shutdown is not None:
            shutdown()
