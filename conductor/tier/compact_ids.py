"""Answered ids leave the registry for their packed form (issue 25).

A job's id registry (``M:in:J:sums``) and done marks (``M:job:J:items``) hold about 135 bytes of
Redis per answered item, forever: a job of millions of items outgrew a Redis of fixed size even with
its backlog and results in the store. The maintenance lease holder compacts each job of its model
whose done marks reach MIN_DONE: lua/compact_ids.lua moves answered ids, 2,000 a call, to the job's
packed form (``M:job:J:packed``, 16 bytes an id: lua/lib_packed.lua), where submit.lua,
register_segment.lua, complete.lua and the requeue still find them: a re-submitted id is still a
duplicate (or a conflict, with other content), and an answered item is never answered twice.
"""

from __future__ import annotations

import math

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.scripts import ScriptClient

MIN_DONE = 2000  # done marks a job holds before the lease holder packs them
CALL_IDS = 2000  # ids per compact_ids.lua call
BUCKET_IDS = 32  # ids per bucket aimed at, for the job's size when it is first packed


def bucket_digits(items: int) -> int:
    """Hex digits of SHA-1(id) naming a bucket, 1..4: buckets of about BUCKET_IDS ids of ``items``.
    A bucket field costs some 50 bytes, and a lookup reads whole buckets (16 bytes an id): small
    buckets make lookups cheap, enough ids per bucket make the field's cost small. 16**4 buckets
    hold 15 ids each at a million ids, 150 at ten million."""
    return min(4, max(1, round(math.log(max(items, 1) / BUCKET_IDS, 16))))


def drop_drained_stored(c: ScriptClient, mk: K.ModelKeys, job: str) -> bool:
    """Delete the job's M:in:J:stored once it holds no id (its buckets left as empty strings: the
    scripts that take ids out run as producers too, whose ACL has no HDEL; a million-item job
    leaves about 2.6 MB of them). Optimistic: a segment registered meanwhile keeps it. True if deleted."""
    key = mk.job_stored(job)
    if c.r.hget(key, "n") not in (b"0", "0"):
        return False  # the common case, in one read: no stored form, or one still holding ids
    with c.r.pipeline() as p:
        try:
            p.watch(key)
            n = p.hget(key, "n")
            if n is None or int(as_str(n)) != 0:
                return False
            p.multi()
            p.delete(key)
            p.execute()
            return True
        except redis.WatchError:
            return False  # written meanwhile: the next pass looks again


def compact_job(c: ScriptClient, model: str, job: str, min_done: int = MIN_DONE) -> int:
    """Pack the answered ids of ``job`` on ``model`` when it has at least ``min_done``; how many.
    A store-waiting id form emptied by the feed is deleted too."""
    mk = K.ModelKeys(model)
    drop_drained_stored(c, mk, job)
    if c.r.hlen(mk.job_items(job)) < min_done:
        return 0
    # the job's size: declared (conductor submit of a file declares it first) or submitted so far
    declared, submitted = c.r.hmget(mk.job_intake(job), ["declared", "submitted"])
    k = bucket_digits(max(int(as_str(v)) for v in (declared or b"0", submitted or b"0")))
    packed, batch = 0, []
    for iid, mark in c.r.hscan_iter(mk.job_items(job), count=CALL_IDS):
        if mark == b"d":
            batch.append(as_str(iid))
        if len(batch) >= CALL_IDS:
            packed += calls.compact_ids(mk, job, k, batch).run(c.scripts)
            batch = []
    if batch:
        packed += calls.compact_ids(mk, job, k, batch).run(c.scripts)
    return packed


def compact_model(c: ScriptClient, model: str, min_done: int = MIN_DONE) -> int:
    """Every job of ``model``; the ids packed."""
    packed = 0
    for job in (as_str(j) for j in c.r.zrange(K.JOBS_KEY, 0, -1)):
        if c.r.sismember(K.job_models_key(job), model):
            packed += compact_job(c, model, job, min_done)
    return packed
