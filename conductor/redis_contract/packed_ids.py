"""The packed forms of a job's ids (issue 25), read from Python: answered ids (``M:job:J:packed``)
and ids waiting in store segments (``M:in:J:stored``, schema 6).

lua/lib_packed.lua holds the layout. Once an id is answered, the maintenance lease holder
(conductor/tier/compact_ids.py, lua/compact_ids.lua) moves it out of the job's id registry
(``M:in:J:sums``, about 80 bytes an id) and done marks (``M:job:J:items``, about 55) into a 16-byte
record (8 bytes of SHA-1(id), 8 of its content sum) in a bucket of the packed hash; an id a
producer writes to a store segment waits in the same form in the stored hash
(lua/register_segment.lua) until the feeder places it in a lane. This mirror answers the same
question as the Lua (does this hash hold this id, with which sum) for the producer's pre-checks and
for conductor/verify/.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str

RECORD = 16


def place(iid: str, k: int) -> tuple[str, bytes]:
    """The id's bucket field and its 8-byte fingerprint (lua/lib_packed.lua packed_place)."""
    h = hashlib.sha1(iid.encode()).hexdigest()
    return "b" + h[:k], bytes.fromhex(h[4:20])


def find(bucket: bytes | None, fp: bytes) -> str | None:
    """The 16 hex digits of the sum stored with ``fp`` in ``bucket``, or None."""
    if not bucket:
        return None
    for at in range(0, len(bucket), RECORD):
        if bucket[at:at + 8] == fp:
            return bucket[at + 8:at + RECORD].hex()
    return None


def sums_in(r: redis.Redis, key: str, ids: Sequence[str]) -> list[str | None]:
    """For each id: the 16 hex digits of its content sum when the packed hash ``key`` holds it."""
    k = r.hget(key, "k")
    if k is None or not ids:
        return [None] * len(ids)
    places = [place(i, int(as_str(k))) for i in ids]
    fields = sorted({f for f, _fp in places})  # each bucket read once, however many ids it holds
    buckets: dict[str, bytes | None] = {}
    for start in range(0, len(fields), 2000):
        part = fields[start:start + 2000]
        got: list[bytes | None] = r.hmget(key, part)  # type: ignore[assignment]
        buckets.update(zip(part, got, strict=True))
    return [find(buckets[f], fp) for f, fp in places]


def packed_sums(r: redis.Redis, mk: K.ModelKeys, job: str, ids: Sequence[str]) -> list[str | None]:
    """For each id: the 16 hex digits of its content sum when the job's packed form holds it (answered)."""
    return sums_in(r, mk.job_packed(job), ids)


def stored_sums(r: redis.Redis, mk: K.ModelKeys, job: str, ids: Sequence[str]) -> list[str | None]:
    """For each id: the 16 hex digits of its content sum when it waits in a store segment."""
    return sums_in(r, mk.job_stored(job), ids)


def known_sums(r: redis.Redis, mk: K.ModelKeys, job: str, ids: Sequence[str]) -> list[str | None]:
    """For each id: its content sum wherever the job knows it (the registry, a store segment, or
    answered and packed); '-' for an id registered before sums were kept; None for a new id."""
    got: list[bytes | None] = r.hmget(mk.job_sums(job), list(ids)) if ids else []  # type: ignore[assignment]
    out: list[str | None] = [as_str(v) if v is not None else None for v in got]
    for key in (mk.job_packed(job), mk.job_stored(job)):
        missing = [i for i, v in enumerate(out) if v is None]
        if not missing:
            break
        for i, s in zip(missing, sums_in(r, key, [ids[i] for i in missing]), strict=True):
            out[i] = s
    return out


def packed_count(r: redis.Redis, mk: K.ModelKeys, job: str) -> int:
    """How many answered ids the job's packed form holds (its field 'n')."""
    raw = r.hget(mk.job_packed(job), "n")
    return int(as_str(raw)) if raw is not None else 0


def stored_count(r: redis.Redis, mk: K.ModelKeys, job: str) -> int:
    """How many ids of the job wait in store segments (M:in:J:stored, its field 'n')."""
    raw = r.hget(mk.job_stored(job), "n")
    return int(as_str(raw)) if raw is not None else 0


def job_segments(r: redis.Redis, mk: K.ModelKeys, job: str) -> list[str]:
    """The store segments of ``job`` on the model (M:segs, each index record's ``job``; one round
    trip for the records): where its stored ids wait, each listed in ``M:seg:N:ids``."""
    names = [as_str(n) for n in r.zrange(mk.segs, 0, -1)]
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hget(mk.seg(name), "job")
    return [name for name, owner in zip(names, pipe.execute(), strict=True) if as_str(owner, absent="") == job]
