"""Making room in a full Redis before work is refused (issue 25).

The disk tier bounds the tokens that wait in Redis; the results of a long job grow with its items.
When Redis nears ``maxmemory`` (or the feeder's load was refused over it), the maintenance lease
holder moves every job's result records of the model but the newest ROOM_WINDOW to result segments
in the store (``result_segments.offload_job``; lua/offload_results.lua is allow-oom) and packs the
jobs' answered ids (conductor/tier/compact_ids.py; lua/compact_ids.lua is allow-oom), so the
waiting backlog can be fed again. Readers lose nothing: ``conductor results`` reads segments and
stream as one, in order, each record once, also while following.
"""

from __future__ import annotations

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.scripts import ScriptClient
from conductor.tier.compact_ids import compact_job
from conductor.tier.object_store import Store
from conductor.tier.result_segments import offload_job

# used_memory over maxmemory from which the lease holder makes room before anything is refused
PRESSURE = 0.7
# Results kept in Redis per job while making room: segments of fewer records cost a file each for
# little memory (the stream then holds at most this many per job).
ROOM_WINDOW = 200
# Done marks a job may keep in Redis while making room (fewer than a compact_ids.lua call's worth)
ROOM_IDS = 200


def memory_pressure(r: redis.Redis) -> bool | None:
    """True when used_memory is past PRESSURE of maxmemory; False without a cap or below it; None
    when INFO is refused (a least-privilege worker user: -@dangerous): then only a refusal tells."""
    try:
        info = r.info("memory")
    except redis.exceptions.NoPermissionError:
        return None
    cap = int(info.get("maxmemory", 0) or 0)
    return cap > 0 and int(info.get("used_memory", 0)) > PRESSURE * cap


def make_room(c: ScriptClient, store: Store, model: str) -> int:
    """Move the result records of every job of ``model`` past ROOM_WINDOW to the store, and pack
    every answered id of its jobs (conductor/tier/compact_ids.py); the records and ids moved."""
    moved = 0
    for job in (as_str(j) for j in c.r.zrange(K.JOBS_KEY, 0, -1)):
        if c.r.sismember(K.job_models_key(job), model):
            moved += offload_job(c.r, c.scripts, store, model, job, ROOM_WINDOW)
            moved += compact_job(c, model, job, min_done=ROOM_IDS)
    return moved
