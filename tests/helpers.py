"""Test helpers that drive the scripts directly and read Redis back."""

from __future__ import annotations

import time
from collections.abc import Callable

from conductor.client import Conductor
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Batch, Contract, Result

MK = K.ModelKeys("m")  # the keys of model "m", the model most tests use


def contract(size: int = 64, tokens: int = 8192, *, model: str = "m", max_input_len: int = 100000) -> Contract:
    """A worker's contract: batch size and token budget, for model "m" unless told."""
    return Contract(model=model, max_batch_size=size, max_batch_tokens=tokens, max_input_len=max_input_len)


def results_for(batch: Batch, worker: str = "w", error: bool = False) -> list[Result]:
    from conductor.redis_contract.records import ResultError
    return [Result(id=i.id, model=batch.model, job=i.job, output="out", output_tokens=1,
                   error=ResultError("boom", "x") if error else None, shape=batch.shape, epoch=batch.epoch,
                   lane=batch.lane, batch=batch.batch_id, batch_size=len(batch.items),
                   batch_padded_len=batch.padded_len, input_tokens=i.input_tokens, worker=worker,
                   claimed_at=batch.claimed_at, finished_at=0) for i in batch.items]


def drain(c: Conductor, contract: Contract, consumer: str = "w", complete: bool = True,
          timeout: float = 10.0) -> list[Batch]:
    """Claim (and complete) until the model is idle."""
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b, why = c.claim(contract, consumer)
        if b is None:
            if why == "idle":
                return out
            time.sleep(0.02)
            continue
        out.append(b)
        if complete:
            c.complete(b, results_for(b, consumer))
    raise AssertionError("model did not go idle")


def quick(c: Conductor, model: str = "m", **cfg) -> None:
    """Thresholds that let small tests dispatch without waiting for a big backlog."""
    base = {"quiet_ms": 50, "release_batches": 0, "activate_batches": 0}
    base.update(cfg)
    c.set_config(model, base)


def jv(v: object) -> bytes:
    """A value as JSON text; bytes are taken as already-written JSON text (to send broken JSON)."""
    import json
    return v if isinstance(v, bytes) else json.dumps(v).encode()


def record(id: object, job: object, tok: object, mt: object, body: bytes = b'["p", null]') -> bytes:
    """An item record as a producer writes it for submit.lua: [id, job, input_tokens, max_tokens]
    followed by the tail of the JSON body [prompt, payload]."""
    return b"[" + b",".join([jv(id), jv(job), jv(tok), jv(mt)]) + b"," + body[1:]


def submit_argv(job: str, *rows: tuple) -> list:
    """submit.lua's ARGV from rows (id, sig, tok, mt[, body[, prefix]]); the record's job is the
    call's. Without a prefix, a signature's first row carries the empty prefix [] (as the client
    sends each shape's prefix on its first item of a call) and later rows ''."""
    args: list = [len(rows), job]
    seen: set = set()
    for row in rows:
        id, sig, tok, mt, *rest = row
        body = rest[0] if rest else b'["p", null]'
        prefix = rest[1] if len(rest) > 1 else (b"" if sig in seen else b"[]")
        seen.add(sig)
        args += [sig, record(id, job, tok, mt, body), prefix]
    return args


def wait_for(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
