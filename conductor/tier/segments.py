"""Store segments: the file format of the disk tier's waiting items.

A segment holds items of one model, one job and one shape signature, in arrival order (purity is
a property of the file: seed 002). It is a Parquet file (zstd) of two columns: ``rec``, each item
record byte for byte as submit.lua stores it in a lane (keys.py: the JSON array [id, job,
input_tokens, max_tokens, prompt, payload]), and ``tok``, its input tokens; the file's metadata
key ``conductor`` holds JSON {"v", "model", "job", "sig", "prefix"}. Loading a segment sends its
records through submit.lua unchanged, so workers cannot tell a fed item from a submitted one.

Its name is derived from its content (SHA-1 of model, job, signature and records;
conductor/redis_contract/segment_record.py, the record the scripts take): writing the same items
again writes the same file, and register_segment.lua refuses a name it has.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from conductor.errors import ConductorError
from conductor.redis_contract.item_record import item_record, record_head
from conductor.redis_contract.records import PreparedItem
from conductor.redis_contract.segment_record import Segment
from conductor.tier.object_store import Store
from conductor.tier.parquet_bytes import read_bytes, table_bytes

FORMAT = 1
META_KEY = b"conductor"


class BadSegment(ConductorError):
    """A segment file that does not decode, or whose content is not what its index record says."""


def build(model: str, job: str, items: Sequence[PreparedItem]) -> Segment:
    first = items[0]
    if any(it.sig != first.sig or it.model != model for it in items):
        raise ValueError("a segment holds one model and one shape")
    head = record_head(job)
    return Segment(model, job, first.sig, first.prefix, tuple(item_record(it, head) for it in items),
                   tuple(it.input_tokens for it in items))


def encode(seg: Segment) -> bytes:
    import pyarrow as pa
    meta = json.dumps({"v": FORMAT, "model": seg.model, "job": seg.job, "sig": seg.sig,
                       "prefix": list(seg.prefix)}).encode()
    return table_bytes({"rec": pa.array(seg.records, pa.binary()), "tok": pa.array(seg.tokens, pa.int32())},
                       {META_KEY: meta})


def decode(data: bytes) -> Segment:
    try:
        table = read_bytes(data)
        meta = json.loads((table.schema.metadata or {})[META_KEY])
        if meta.get("v") != FORMAT:
            raise BadSegment(f"segment format {meta.get('v')!r}, this version reads {FORMAT}")
        recs = tuple(table.column("rec").to_pylist())
        toks = tuple(table.column("tok").to_pylist())
        return Segment(meta["model"], meta["job"], meta["sig"], tuple(meta["prefix"]), recs, toks)
    except BadSegment:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file fails in pyarrow, json or a missing key
        raise BadSegment(f"segment does not decode: {type(e).__name__}: {e}") from None


def file_sum(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def read_segment(store: Store, rec: dict[str, str]) -> Segment:
    """The segment an index record names, checked against the record (sum, count, tokens)."""
    data = store.get(rec["path"])
    if file_sum(data) != rec["sum"]:
        raise BadSegment(f"segment {rec['path']} is damaged: its SHA-1 is not the registered one")
    seg = decode(data)
    if len(seg.records) != int(rec["items"]) or sum(seg.tokens) != int(rec["tokens"]) or seg.job != rec["job"] \
            or seg.sig != rec["sig"]:
        raise BadSegment(f"segment {rec['path']} does not hold what its index record says")
    return seg
