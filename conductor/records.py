"""Records that cross process boundaries, as msgspec structs (no pickle anywhere)."""

from __future__ import annotations

from typing import Any

import msgspec


class Contract(msgspec.Struct, frozen=True):
    """The four integers a consumer registers (seeds 001, 002)."""

    model: str
    max_batch_size: int
    max_batch_tokens: int
    max_input_len: int


class BatchItem(msgspec.Struct, array_like=True, gc=False):
    """One item of a batch. Array-like: an item record in Redis is the JSON array
    ``[id, job, input_tokens, max_tokens, prompt, payload]`` (conductor/keys.py), which decodes
    straight into this struct; ``deliveries`` comes from the batch. Not tracked by the garbage
    collector (a decoded item cannot be part of a cycle): a worker makes thousands a second."""

    id: str
    job: str
    input_tokens: int
    max_tokens: int
    prompt: str
    payload: Any = None
    deliveries: int = 1
    # Why the record's prompt and payload could not be read ('' when they could): the worker
    # answers such an item with a bad_record error instead of running it.
    unreadable: str = ""


class Batch(msgspec.Struct):
    """Items of ONE lane of ONE shape instance of ONE model, packed under a contract."""

    model: str
    batch_id: str
    shape: str
    epoch: int
    lane: int
    padded_len: int
    max_tokens: int
    claimed_at: int
    items: list[BatchItem]
    prefix: list[str] = []
    cleanup: bool = False
    reclaimed: bool = False
    hygiene: bool = False
    warming: str = ""  # the shape instance "sig:epoch" being pre-warmed, if any (the pre-warm signal)

    @property
    def padded_tokens(self) -> int:
        return self.padded_len * len(self.items)

    @property
    def actual_tokens(self) -> int:
        return sum(i.input_tokens for i in self.items)


class ResultError(msgspec.Struct):
    code: str
    message: str


class Result(msgspec.Struct, omit_defaults=False):
    """One line of ``conductor results``: enough to audit padding, purity, fill and order."""

    id: str
    model: str
    job: str
    output: str
    output_tokens: int
    error: ResultError | None
    shape: str
    epoch: int
    lane: int
    batch: str
    batch_size: int
    batch_padded_len: int
    input_tokens: int
    worker: str
    claimed_at: int
    finished_at: int
    deliveries: int = 1
    payload: Any = None


json_encoder = msgspec.json.Encoder()
result_decoder = msgspec.json.Decoder(Result)
