"""Schema 3: the producer's keys apart from the workers', so that an ACL can give a producer
write access to its own keys only (deploy/redis/users.acl; issue 13's least privilege).

Stop every worker and producer before ``conductor migrate``.

Per model (``SMEMBERS cdr:models``, ``M`` = ``cdr:{model}``, layout in conductor/redis_contract/keys.py):

* the producer's fields of ``M:state`` (tokens, items, submitted, last_intake_ms, sealed_ms)
  move to the new hash ``M:intake``;
* per job J: the producer's fields of ``M:job:J`` (declared, submitted, submitted_tokens) move
  to ``M:in:J``; ``M:job:J:sums`` becomes ``M:in:J:sums``, the job's id registry: every id of
  ``M:job:J:items`` without a sum gets '-' (unknown content: a re-submit of it stays a
  duplicate, as before); ``M:job:J:items`` keeps only the done marks ('d'), its 'q' entries go.

Each step is one Lua call (a model's state, a job's hashes, one page of a job's items), so a
crash midway leaves each step old or new, and running ``up`` again finishes what is left.
"""

from __future__ import annotations

import re

import redis

VERSION = 3

# Key names are spelled out here rather than taken from conductor/redis_contract/keys.py: a migration moves
# one fixed layout to the next and must not follow later renames.
_STATE_FIELDS = ("tokens", "items", "submitted", "last_intake_ms", "sealed_ms")
_JOB_FIELDS = ("declared", "submitted", "submitted_tokens")
PAGE = 1000

# KEYS[1] from hash, KEYS[2] to hash; ARGV fields. A field already in the target stays (a re-run).
_MOVE_LUA = r"""
for _, f in ipairs(ARGV) do
  local v = redis.call('HGET', KEYS[1], f)
  if v then
    redis.call('HSETNX', KEYS[2], f, v)
    redis.call('HDEL', KEYS[1], f)
  end
end
return 1
"""

# KEYS[1] old sums, KEYS[2] new sums: renamed unless the new one exists already (a re-run).
_RENAME_LUA = r"""
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])
end
return 1
"""

# KEYS[1] items (id -> q|d), KEYS[2] sums (the registry); ARGV ids of one page.
_ITEMS_LUA = r"""
for _, id in ipairs(ARGV) do
  local st = redis.call('HGET', KEYS[1], id)
  if st then
    redis.call('HSETNX', KEYS[2], id, '-')
    if st ~= 'd' then redis.call('HDEL', KEYS[1], id) end
  end
end
return 1
"""


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _glob_escape(s: str) -> str:
    return re.sub(r"([\[\]*?\\])", r"\\\1", s)


def up(client: redis.Redis) -> None:
    move = client.register_script(_MOVE_LUA)
    rename = client.register_script(_RENAME_LUA)
    items = client.register_script(_ITEMS_LUA)
    for model in sorted(_s(m) for m in client.smembers("cdr:models")):
        base = f"cdr:{{{model}}}"
        move(keys=[f"{base}:state", f"{base}:intake"], args=list(_STATE_FIELDS))
        job_re = re.compile(rf"^{re.escape(base)}:job:([^:]+)$")
        jobs = sorted({m.group(1) for k in client.scan_iter(match=_glob_escape(f"{base}:job:") + "*", count=1000)
                       if (m := job_re.match(_s(k)))})
        for job in jobs:
            jk, ik = f"{base}:job:{job}", f"{base}:in:{job}"
            move(keys=[jk, ik], args=list(_JOB_FIELDS))
            rename(keys=[f"{jk}:sums", f"{ik}:sums"])
            cursor = 0
            while True:
                cursor, page = client.hscan(f"{jk}:items", cursor, count=PAGE)
                if page:
                    items(keys=[f"{jk}:items", f"{ik}:sums"], args=[_s(k) for k in page])
                if cursor == 0:
                    break
