"""Records that cross process boundaries, as msgspec structs (no pickle anywhere)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from conductor.errors import BadInput
from conductor.redis_contract.keys import check_name


class PreparedItem(msgspec.Struct, frozen=True):
    """A validated item, ready for submit.lua (conductor/formats/lines.py makes them from input lines;
    conductor/redis_contract/item_record.py builds its record)."""

    id: str
    model: str
    sig: str
    input_tokens: int
    max_tokens: int
    body: bytes  # JSON [prompt, payload]
    prefix: tuple[str, ...]


class Contract(msgspec.Struct, frozen=True):
    """The four integers a consumer registers (seeds 001, 002)."""

    model: str
    max_batch_size: int
    max_batch_tokens: int
    max_input_len: int


class BatchItem(msgspec.Struct, array_like=True, gc=False):
    """One item of a batch. Array-like: an item record in Redis is the JSON array
    ``[id, job, input_tokens, max_tokens, prompt, payload]`` (conductor/redis_contract/keys.py), which decodes
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
    def key(self) -> str:
        """The batch among all a worker holds: a stream id is unique only in its stream, and each shard of
        a sharded model has its own (two shards can issue the same id in one millisecond). A stream id
        has no '/', so the last one splits the key again."""
        return f"{self.model}/{self.batch_id}"

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


# ---------------------------------------------------------------- item records read by workers

_items_decoder = msgspec.json.Decoder(list[BatchItem])
_item_decoder = msgspec.json.Decoder(BatchItem)


def decode_items(records: list[bytes]) -> list[BatchItem]:
    """Item records (JSON arrays, conductor/redis_contract/keys.py) to BatchItems: one decode call per batch."""
    try:
        return _items_decoder.decode(b"[" + b",".join(records) + b"]")
    except msgspec.DecodeError:
        pass
    # submit.lua checked each body with cjson, which takes a few forms msgspec refuses (NaN,
    # Infinity, hex numbers, leading zeros): the standard library reads the first two; a record
    # neither reads becomes an unreadable item, which the worker answers with an error.
    out = []
    for rec in records:
        try:
            out.append(_item_decoder.decode(rec))
        except msgspec.DecodeError:
            try:
                out.append(msgspec.convert(json.loads(rec), BatchItem))
            except (ValueError, msgspec.ValidationError) as e:
                out.append(_unreadable_item(rec, e))
    return out


def _unreadable_item(rec: bytes, err: Exception) -> BatchItem:
    """An item no decoder reads, still answerable: submit.lua checked with cjson that id and job
    are strings and input_tokens and max_tokens whole numbers, but a producer may write those
    numbers in forms only cjson takes (leading zeros, hex), which are read here the same way."""
    text = rec.decode("utf-8", errors="replace")
    dec = json.JSONDecoder(strict=False)
    head: list[Any] = []
    pos = 1
    for k in range(4):
        pos = len(text) - len(text[pos:].lstrip())
        if k < 2:
            value, pos = dec.raw_decode(text, pos)
        else:
            end = text.index(",", pos)
            value, pos = _lenient_int(text[pos:end]), end
        head.append(value)
        pos = text.index(",", pos) + 1
    iid, job, tok, mt = head
    return BatchItem(id=iid, job=job, input_tokens=tok, max_tokens=mt, prompt="",
                     unreadable=f"the item's record is not JSON this worker can read: {err}")


def _lenient_int(text: str) -> int:
    """A whole number as cjson reads it (strtod: decimal with leading zeros, fraction, exponent,
    hex); 0 when even that fails, so the item is still answered."""
    t = text.strip()
    for conv in (int, lambda x: int(x, 16), float):
        try:
            return int(conv(t))
        except (ValueError, OverflowError):
            continue
    return 0


PRIORITIES = ("interactive", "batch", "background")


@dataclass(frozen=True)
class JobClass:
    """A job's tenant, priority class and deadline (lua/job_class.lua; conductor/jobs/job_class.py)."""

    tenant: str = ""  # '' : the job is its own tenant
    priority: str = "batch"
    deadline_ms: int = 0  # 0: none

    def __post_init__(self) -> None:
        if self.tenant:
            try:
                check_name("tenant", self.tenant)
            except ValueError as e:
                raise BadInput("tenant", str(e).split(": ", 1)[-1]) from None
        if self.priority not in PRIORITIES:
            raise BadInput("priority", f"must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
