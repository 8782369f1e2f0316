"""``torch``: a real PyTorch / transformers causal LM under the continuous-batching protocol.

``model_path`` is a local folder with a transformers model and tokenizer (nothing is ever
downloaded: ``local_files_only``), or ``tiny``: a random-initialised two-layer Llama built
from a config with a byte-level tokenizer, for tests and demos (its text is noise; its forward
passes, KV cache and batching are real).

How a batch runs:

* The prompt of an item is ``"\\n".join(batch.prefix) + "\\n" + prompt`` (just ``prompt``
  without a prefix). Every item of a batch shares the shape's prefix, so the prefix's KV is
  computed once per shape (batch of one) and kept in a small LRU keyed by shape signature;
  each later batch of that shape copies it and repeats it across its rows
  (``DynamicCache.batch_repeat_interleave``) and only runs the suffixes. The last prefix
  token travels with the suffix so every row has at least one new token to predict from.
* Suffixes of different lengths are padded between the prefix and the suffix; the attention
  mask hides the pads and position ids skip them, so each row sees exactly its own prompt.
* A new batch is prefilled on its own, then merged into the running set: shorter caches are
  padded on the left (masked), so one forward pass per ``step`` decodes every live sequence,
  whichever batch it came from. A row that finishes (EOS or its ``max_tokens``) leaves at
  once and its KV rows are dropped (``batch_select_indices``); columns no live row needs any
  more are cut off the front. Caches whose layers are not plain key/value tensors (sliding
  windows, hybrid models) are not merged: such batches decode as separate cohorts.
* Greedy decoding: the same prompt gives the same output, in any batch. A request's options
  (conductor/formats/openai_options.py ``request_options``) are honoured per row: ``temperature`` above 0
  samples (with ``top_p``, nucleus sampling; ``top_p`` alone samples at temperature 1), from a
  generator of the row's own seeded with ``seed`` (or with the item id), so a row samples the same
  tokens in any batch; ``stop`` ends the row before the first stop string its text contains;
  ``max_tokens`` (``max_completion_tokens``) caps its length.
* It runs at most ``max_num_seqs`` rows at once (default: the batch size, as vLLM's batch is its
  ``max_num_seqs``; 0: no limit). Rows given beyond them wait in the engine, first in first out, and are
  prefilled as running rows finish; ``room`` is vLLM's (a batch's worth once what has not started is
  under half the last batch given, else none), so the worker holds about one batch beyond what runs.
* Prefix hits are counted in the item's own ``input_tokens`` (its share of the prompt the cached
  prefix covers): the tokenizer's count of a prompt differs from the producer's, and the hit
  ratio ``conductor run`` reports is against ``input_tokens``.
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conductor.formats.openai_options import request_options
from conductor.redis_contract.records import Batch, BatchItem, Contract, ResultError

from .base import ContractHolder, EngineConfigError, EngineUnavailable, Finished, too_long
from .byte_tokenizer import ByteTokenizer
from .waiting import HoldsWaiting, Waiting

TINY_CONFIG: dict[str, Any] = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def _torch() -> Any:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise EngineUnavailable(
            f"engine torch needs PyTorch and transformers ({e.name} is missing): "
            "pip install 'conductor[torch]' (torch==2.13.0)") from None
    return torch


@dataclass
class TorchCounters:
    prefix_computes: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    output_tokens: int = 0
    finished: int = 0
    merges: int = 0


class _Sampling:
    """One row's request options: how its next token is chosen and when its text ends."""

    __slots__ = ("temperature", "top_p", "gen", "stop")

    def __init__(self, torch: Any, item: BatchItem, device: str) -> None:
        opts = request_options(item.payload)
        top_p = opts.get("top_p")
        temperature = opts.get("temperature", 1.0 if top_p is not None else 0.0)
        self.temperature = float(temperature)
        self.top_p = float(top_p) if top_p is not None else 1.0
        self.stop: list[str] = list(opts.get("stop", ()))
        self.gen = None
        if self.temperature > 0:
            seed = opts.get("seed")
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed((seed if seed is not None else hash_id(item.id)) % (2 ** 63))

    @property
    def greedy(self) -> bool:
        return self.gen is None

    def pick(self, torch: Any, logits: Any) -> int:
        """The next token from one row's logits (1-D)."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))


def hash_id(item_id: str) -> int:
    import hashlib
    return int.from_bytes(hashlib.blake2b(item_id.encode(), digest_size=8).digest(), "little")


@dataclass
class _Cohort:
    batches: list[Batch]  # per row: the batch the row's item came in
    items: list[BatchItem]
    cache: Any
    mask: Any  # (rows, seen) attention mask over everything in the cache
    pos: Any  # (rows,) position id of the next token
    last: Any  # (rows,) the token to feed next
    out: list[list[int]] = field(default_factory=list)
    sampling: list[_Sampling] = field(default_factory=list)  # per row


class TorchEngine(HoldsWaiting, ContractHolder):
    kind = "torch"

    def __init__(self, model: str, *, model_path: str | None = None, max_batch_size: int = 16,
                 max_batch_tokens: int = 8192, max_input_len: int = 1024, device: str | None = None,
                 prefix_cache_shapes: int = 4, seed: int = 0, max_num_seqs: int | None = None) -> None:
        if not model_path:
            raise EngineConfigError("--model-path: the torch engine needs a local model folder, or 'tiny'")
        torch = _torch()
        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model_path == "tiny":
            from transformers import LlamaConfig, LlamaForCausalLM
            torch.manual_seed(seed)
            cfg = LlamaConfig(**TINY_CONFIG)
            # Any: transformers types PreTrainedModel.to through a decorator that mypy reads as
            # taking the model, not the device
            self.lm: Any = LlamaForCausalLM(cfg)  # type: ignore[no-untyped-call]  # untyped in transformers 5.19
            self.tok: Any = ByteTokenizer()
            self.eos = ByteTokenizer.eos_token_id
            self.pad = ByteTokenizer.pad_token_id
            self._encode: Callable[[str, bool], list[int]] = lambda text, bos: self.tok.encode(text, bos=bos)
            limit = cfg.max_position_embeddings
        else:
            self.lm, self.tok, limit = self._load(model_path)
            self.eos = self.tok.eos_token_id
            self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos
            bos = self.tok.bos_token_id

            def encode(text: str, with_bos: bool) -> list[int]:
                ids = self.tok.encode(text, add_special_tokens=False)
                return [bos, *ids] if with_bos and bos is not None else ids
            self._encode = encode
        self.lm.to(self.device).eval()
        self.max_positions = int(limit)
        self._contract = Contract(model=model, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                  max_input_len=min(max_input_len, self.max_positions))
        self._cache_kw = "cache" if "cache" in inspect.signature(self.lm.forward).parameters else "past_key_values"
        self._prefixes: OrderedDict[str, tuple[list[int], Any]] = OrderedDict()
        self.prefix_cache_shapes = prefix_cache_shapes
        self.cohorts: list[_Cohort] = []
        self.counters = TorchCounters()
        self._waiting = Waiting(max_batch_size if max_num_seqs is None else max_num_seqs, max_batch_size)

    def _load(self, path: str) -> tuple[Any, Any, int]:
        from pathlib import Path

        from transformers import AutoModelForCausalLM, AutoTokenizer
        if not Path(path).is_dir():
            raise EngineConfigError(f"--model-path: {path!r} is not a folder (a local transformers model, or 'tiny')")
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        dtype = self.torch.bfloat16 if self.device.startswith("cuda") else self.torch.float32
        lm = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        limit = getattr(lm.config, "max_position_embeddings", None) or 4096
        return lm, tok, limit

    # ------------------------------------------------------------------ forward passes
    def _forward(self, ids: Any, mask: Any, pos: Any, cache: Any) -> tuple[Any, Any]:
        kw = {self._cache_kw: cache} if cache is not None else {}
        with self.torch.inference_mode():
            out = self.lm(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        new_cache = getattr(out, "cache", None) if self._cache_kw == "cache" else None
        return out.logits[:, -1, :], new_cache if new_cache is not None else out.past_key_values

    def _prefix(self, shape: str, prefix: list[str]) -> tuple[list[int], Any]:
        """The shape's prefix ids without their last token, and their KV (None when empty)."""
        hit = self._prefixes.get(shape)
        if hit is not None:
            self._prefixes.move_to_end(shape)
            return hit
        ids = self._encode("\n".join(prefix) + "\n" if prefix else "", True)[:-1]
        cache = None
        if ids:
            t = self.torch.tensor([ids], device=self.device)
            _, cache = self._forward(t, self.torch.ones_like(t), self.torch.arange(len(ids), device=self.device)[None],
                                     None)
            self.counters.prefix_computes += 1
            self.counters.prefill_tokens += len(ids)
        self._prefixes[shape] = (ids, cache)
        while len(self._prefixes) > self.prefix_cache_shapes:
            self._prefixes.popitem(last=False)
        return ids, cache

    # ------------------------------------------------------------------ protocol
    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        if not items:
            return []
        self._waiting.add(batch, items)
        return self._start()

    def _running(self) -> int:
        return sum(len(c.items) for c in self.cohorts)

    def _start(self) -> list[Finished]:
        """Prefill what waits, oldest first, while fewer than max_num_seqs rows run (a batch may start in
        parts); returns the rows refused or finished at once."""
        out: list[Finished] = []
        for batch, items in self._waiting.startable(self._running):
            out += self._prefill(batch, items)
        return out

    def _prefill(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        torch = self.torch
        limit = self._contract.max_input_len
        pre_ids, pre_cache = self._prefix(batch.shape, batch.prefix)
        full = self._encode("\n".join(batch.prefix) + "\n" if batch.prefix else "", True)
        refused, rows, suffixes = [], [], []
        for it in items:
            suffix = full[len(pre_ids):] + self._encode(it.prompt, False)
            n = len(pre_ids) + len(suffix)
            if it.input_tokens > limit:
                refused.append(too_long(batch, it, limit))
            elif n > limit or n + it.max_tokens > self.max_positions:
                refused.append(Finished(batch, it, "", 0, ResultError(
                    "input_too_long", f"prompt is {n} tokens for this model's tokenizer (+ max_tokens "
                    f"{it.max_tokens}); this engine takes max_input_len {limit}, {self.max_positions} positions")))
            else:
                rows.append(it)
                suffixes.append(suffix)
        if not rows:
            return refused
        p, s = len(pre_ids), max(len(x) for x in suffixes)
        ids = torch.full((len(rows), s), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), p + s), dtype=torch.long)
        mask[:, :p] = 1
        for r, suf in enumerate(suffixes):
            ids[r, s - len(suf):] = torch.tensor(suf)
            mask[r, p + s - len(suf):] = 1
        pos_all = (mask.cumsum(1) - 1).clamp(min=0)
        ids, mask, pos_all = ids.to(self.device), mask.to(self.device), pos_all.to(self.device)
        cache = None
        if pre_cache is not None:
            cache = copy.deepcopy(pre_cache)
            cache.batch_repeat_interleave(len(rows))
            # in the item's own input_tokens: its tokenizer count may be several times the producer's
            self.counters.prefix_hit_tokens += sum(min(it.input_tokens, it.input_tokens * p // (p + len(suf)))
                                                   for it, suf in zip(rows, suffixes, strict=True))
        logits, cache = self._forward(ids, mask, pos_all[:, p:], cache)
        self.counters.prefill_tokens += sum(len(x) for x in suffixes)
        sampling = [_Sampling(torch, it, self.device) for it in rows]
        c = _Cohort([batch] * len(rows), rows, cache, mask, pos_all[:, -1] + 1, self._pick(logits, sampling),
                    [[] for _ in rows], sampling)
        self.cohorts.append(c)
        done = self._harvest(c)
        if len(self.cohorts) > 1 and c in self.cohorts and self._mergeable(self.cohorts[0]) and self._mergeable(c):
            self._merge_into(self.cohorts[0], c)
        return refused + done

    @staticmethod
    def _mergeable(c: _Cohort) -> bool:
        layers = getattr(c.cache, "layers", None)
        if not layers:
            return False
        return all(type(x).__name__ == "DynamicLayer" and getattr(x, "keys", None) is not None
                   and x.keys.dim() == 4 for x in layers)

    def _merge_into(self, a: _Cohort, b: _Cohort) -> None:
        """Append b's rows to a: left-pad the shorter cache (and mask) so both have one length."""
        F = self.torch.nn.functional
        la, lb = a.mask.shape[1], b.mask.shape[1]
        n = max(la, lb)
        for x, y in zip(a.cache.layers, b.cache.layers, strict=True):
            x.keys = self.torch.cat([F.pad(x.keys, (0, 0, n - la, 0)), F.pad(y.keys, (0, 0, n - lb, 0))])
            x.values = self.torch.cat([F.pad(x.values, (0, 0, n - la, 0)), F.pad(y.values, (0, 0, n - lb, 0))])
        a.mask = self.torch.cat([F.pad(a.mask, (n - la, 0)), F.pad(b.mask, (n - lb, 0))])
        a.pos, a.last = self.torch.cat([a.pos, b.pos]), self.torch.cat([a.last, b.last])
        a.batches += b.batches
        a.items += b.items
        a.out += b.out
        a.sampling += b.sampling
        self.cohorts.remove(b)
        self.counters.merges += 1

    def _trim(self, c: _Cohort) -> None:
        """Cut columns that no live row attends to off the front of the cache and the mask."""
        if not self._mergeable(c):
            return
        used = c.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first > 0:
            for x in c.cache.layers:
                x.keys, x.values = x.keys[:, :, first:], x.values[:, :, first:]
            c.mask = c.mask[:, first:]

    def _pick(self, logits: Any, sampling: list[_Sampling]) -> Any:
        """Each row's next token: the argmax, or a draw for a row whose request samples."""
        nxt = logits.argmax(-1)
        for r, s in enumerate(sampling):
            if not s.greedy:
                nxt[r] = s.pick(self.torch, logits[r])
        return nxt

    def _text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids) if isinstance(self.tok, ByteTokenizer)
                   else self.tok.decode(ids, skip_special_tokens=True))

    def _harvest(self, c: _Cohort) -> list[Finished]:
        """Record each row's new token; rows that end leave the cohort and its cache."""
        done, keep = [], []
        for r, tok in enumerate(c.last.tolist()):
            it = c.items[r]
            if tok != self.eos:
                c.out[r].append(tok)
            stops = c.sampling[r].stop if c.sampling else []
            text = self._text(c.out[r]) if stops else ""
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if tok == self.eos or len(c.out[r]) >= it.max_tokens or cut >= 0:
                if cut >= 0:  # the row ends before its stop string, which is not part of the answer
                    text = text[:cut]
                    while c.out[r] and len(self._text(c.out[r])) > cut:
                        c.out[r].pop()
                else:
                    text = self._text(c.out[r])
                done.append(Finished(c.batches[r], it, text, len(c.out[r])))
                self.counters.finished += 1
                self.counters.output_tokens += len(c.out[r])
            else:
                keep.append(r)
        if len(keep) < len(c.items):
            if keep:
                idx = self.torch.tensor(keep, device=self.device)
                c.cache.batch_select_indices(idx)
                c.mask, c.pos, c.last = c.mask[idx], c.pos[idx], c.last[idx]
                c.items = [c.items[r] for r in keep]
                c.batches = [c.batches[r] for r in keep]
                c.out = [c.out[r] for r in keep]
                c.sampling = [c.sampling[r] for r in keep]
                self._trim(c)
            else:
                self.cohorts.remove(c)
        return done

    def step(self) -> list[Finished]:
        done: list[Finished] = []
        for c in list(self.cohorts):
            c.mask = self.torch.cat([c.mask, self.torch.ones_like(c.mask[:, :1])], dim=1)
            logits, c.cache = self._forward(c.last[:, None], c.mask, c.pos[:, None], c.cache)
            c.pos = c.pos + 1
            c.last = self._pick(logits, c.sampling)
            done += self._harvest(c)
        if self.cohorts or done:
            self.counters.decode_steps += 1
        return done + self._start()  # into the rows the finished ones left

    def active(self) -> int:
        return self._running() + self._waiting.items

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        """Nothing to build ahead for eager PyTorch; the prefix KV is computed with the first batch."""

    def close(self) -> None:
        self._waiting.clear()
        self.cohorts.clear()
        self._prefixes.clear()
