"""A model's shards (issue 36): one model's shapes spread over several single-slot copies of the
model's layout, so that one model's traffic can use more than one Redis core of a cluster.

``conductor config M shards=S`` (1 by default: the model's own keys, today's layout). A shape
lives on shard XXH64(signature) mod S. Shard s of model m is the model-like name ``m~s.k``: the salt
k is the first that puts the name's hash tag in the s-th S-part of the slot range, so the S
shards land on S different masters of an evenly split cluster. Each shard is a full model in
every other respect (its own cfg, lanes, streams, counters), registered in the models registry
and in the job's models set like any model: every script stays single-slot, and every view that
walks a job's models sees the whole job; views show ``fold(name)``, the model's own name.

A live change of S: the old layout's shards are recorded in ``M:shards_old`` (keys.py); workers serve
them as long as they are recorded, and the model's lease holder moves their waiting shapes to the new
shards (conductor/client/shard_migrate.py, lua/hand_over.lua), then forgets them once empty.

Pure functions only: the Redis reads are the client's (conductor/client/shard_claims.py).
"""

from __future__ import annotations

import re

import xxhash
from redis.crc import key_slot

SEP = "~"
SLOTS = 16384
EDGE = 4
MAX_SHARDS = 64  # beyond it a cluster's masters, not shards, are the limit
_SHARD_RE = re.compile(rf"^(?P<model>.+){SEP}(?P<s>\d+)\.(?P<k>\d+)$")


def slot_of(name: str) -> int:
    """The cluster slot of a model-like name's keys (their hash tag is the name)."""
    return int(key_slot(name.encode()))


def shard_name(model: str, s: int, count: int) -> str:
    """Shard ``s`` of ``count`` of ``model``; the model itself when ``count`` is 1."""
    if count <= 1:
        return model
    # EDGE slots kept off each end of the part: tools split the slot range with their own rounding
    # (redis-cli --cluster create gives 0-5460, 5461-10922, 10923-16383 to three masters)
    lo, hi = s * SLOTS // count + EDGE, (s + 1) * SLOTS // count - EDGE
    k = 0
    while True:  # about ``count`` tries: each salt lands in the part with chance 1/count
        name = f"{model}{SEP}{s}.{k}"
        if lo <= slot_of(name) < hi:
            return name
        k += 1


def shard_names(model: str, count: int) -> list[str]:
    return [shard_name(model, s, count) for s in range(max(1, count))]


def shard_index(sig: str, count: int) -> int:
    """The shard of a shape by its signature's hash (before any recorded placement)."""
    if count <= 1:
        return 0
    return int(xxhash.xxh64_intdigest(sig.encode())) % count


def fold(name: str) -> str:
    """The model a shard belongs to; any other name as it is."""
    m = _SHARD_RE.match(name)
    return m.group("model") if m else name


def is_shard(name: str) -> bool:
    return _SHARD_RE.match(name) is not None


def check_count(raw: object) -> int:
    n = int(str(raw))
    if not 1 <= n <= MAX_SHARDS:
        raise ValueError(f"shards: must be 1..{MAX_SHARDS}, got {n}")
    return n
