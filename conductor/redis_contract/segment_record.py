"""A store segment as the scripts take it: the items of one model, one job and one shape
signature, in arrival order, with its name (derived from its content) and its file's name in the
store. register_segment.lua records it, submit.lua loads its records (``script_calls``); its file
format, the writing and the reading are the disk tier's (conductor/tier/segments.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from conductor.redis_contract import rules


@dataclass(frozen=True)
class Segment:
    model: str
    job: str
    sig: str
    prefix: tuple[str, ...]
    records: tuple[bytes, ...]
    tokens: tuple[int, ...]

    @property
    def name(self) -> str:
        h = hashlib.sha1(b"cdr-segment-1\0")
        for part in (self.model, self.job, self.sig):
            h.update(part.encode() + b"\0")
        for rec in self.records:
            h.update(len(rec).to_bytes(8, "little") + rec)
        return h.hexdigest()[:rules.SEGMENT_NAME_HEX]

    @property
    def file_name(self) -> str:
        return file_name(self.name)


def file_name(name: str) -> str:
    return f"segments/{name[:2]}/{name}.parquet"
