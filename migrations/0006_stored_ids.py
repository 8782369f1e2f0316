"""Schema 6: ids waiting in store segments leave the id registry for a packed form (issue 25).

Stop every worker and producer before ``conductor migrate``.

Under schema 5 an id written to a store segment kept a registry entry ``id -> 's<seq>:<sum>'`` in
``M:in:J:sums`` (about 80 bytes of Redis an id) until the feeder placed it: a backlog of a million
items submitted before any worker ran filled a 64 MB Redis. Under schema 6 it waits as a 16-byte
record (8 bytes of SHA-1(id), 8 of its sum) in ``M:in:J:stored`` (the layout of lua/lib_packed.lua),
and its segment names it in the list ``M:seg:N:ids``. Per model and job (``M`` = ``cdr:{model}``):
every 's<seq>:<sum>' entry of the registry goes to the job's stored ids and to the id list of the
segment registered with that sequence number (``M:segs`` scores), and leaves the registry.

Each job is one MULTI (its stored ids rewritten whole, its segments' id lists rewritten whole, the
marks deleted), so a crash midway leaves each job old or new, and running ``up`` again finds only
the jobs not yet moved. Schema-5 code reads only the marks and would take a moved id for a new one
(a re-sent item would run twice): the version bump makes it refuse this Redis.
"""

from __future__ import annotations

import hashlib
import math

import redis

VERSION = 6

# Key names are spelled out here rather than taken from conductor/redis_contract/keys.py: a
# migration moves one fixed layout to the next and must not follow later renames.
BUCKET_IDS = 32  # as conductor/tier/compact_ids.py and lua/lib_packed.lua packed_digits


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _digits(items: int) -> int:
    return min(4, max(1, math.floor(math.log(max(items, 1) / BUCKET_IDS, 16) + 0.5)))


def _move_job(client: redis.Redis, base: str, job: str) -> int:
    sums_key, stored_key = f"{base}:in:{job}:sums", f"{base}:in:{job}:stored"
    marks: dict[str, list[tuple[str, str]]] = {}  # seq -> [(id, sum)]
    for iid, mark in client.hscan_iter(sums_key, count=1000):
        m = _s(mark)
        if m.startswith("s") and ":" in m:
            seq, sm = m[1:].split(":", 1)
            marks.setdefault(seq, []).append((_s(iid), sm))
    if not marks:
        return 0
    by_seq = {str(int(score)): _s(name) for name, score in client.zrange(f"{base}:segs", 0, -1, withscores=True)}
    declared, submitted = client.hmget(f"{base}:in:{job}", ["declared", "submitted"])
    k = _digits(max(int(declared or 0), int(submitted or 0)))
    buckets: dict[str, bytes] = {}
    n = 0
    pipe = client.pipeline(transaction=True)
    for seq, pairs in sorted(marks.items()):
        for iid, sm in pairs:
            h = hashlib.sha1(iid.encode()).hexdigest()
            field = "b" + h[:k]
            buckets[field] = buckets.get(field, b"") + bytes.fromhex(h[4:20]) + bytes.fromhex(sm)
            n += 1
        name = by_seq.get(seq)
        if name is not None:  # a segment no longer registered names none of its ids (nothing reads them)
            ids_key = f"{base}:seg:{name}:ids"
            pipe.delete(ids_key)
            ids = [iid for iid, _sm in pairs]
            for start in range(0, len(ids), 2000):
                pipe.rpush(ids_key, *ids[start:start + 2000])
    pipe.delete(stored_key)
    pipe.hset(stored_key, mapping={"k": k, "n": n, **buckets})
    all_ids = [iid for pairs in marks.values() for iid, _sm in pairs]
    for start in range(0, len(all_ids), 2000):
        pipe.hdel(sums_key, *all_ids[start:start + 2000])
    pipe.execute()
    return n


def up(client: redis.Redis) -> None:
    for model in sorted(_s(m) for m in client.smembers("cdr:models")):
        base = f"cdr:{{{model}}}"
        for job in sorted(_s(j) for j in client.zrange("cdr:jobs", 0, -1)):
            if client.sismember(f"cdr:job:{job}:models", model):
                _move_job(client, base, job)
