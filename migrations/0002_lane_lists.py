"""Schema 2: lanes become lists of item records, so claim.lua never reads item bytes into Lua.

Stop every worker (and every submitter) before ``conductor migrate``: schema-1 workers would
claim from lanes this migration rewrites, and schema-2 workers refuse a Redis still at 1.

Per model (``SMEMBERS cdr:models``, ``M`` = ``cdr:{model}``, layout in conductor/redis_contract/keys.py):

* every lane stream ``M:lane:S:E:L`` (entries with fields id job tok mt d, ``d`` = body JSON
  ``[prompt, payload]``) becomes a LIST of item records ``[id, job, tok, mt, prompt, payload]``
  plus the parallel ``M:lanetok:S:E:L`` list of input tokens, in the same order;
* every pending schema-1 batch in ``M:batches`` (field ``b``, a msgpack blob) is taken back:
  schema-2 code cannot complete it, so it is acked, deleted and its items still queued are
  pushed to ``M:reclaimed`` in the new format, as lib_requeue.lua would (items already done are
  dropped; the in-flight and reclaimed counters of ``M:state`` move with them);
* every schema-1 entry of ``M:reclaimed`` is rewritten in the new format, in place.

Dead-letter entries stay as they are (dead_retry.lua reads the old ``d`` field too).

Each lane, batch and reclaimed entry moves in one Lua call, so a crash midway leaves each one
either old or new, and running ``up`` again converts only what is still old.
"""

from __future__ import annotations

import re

import redis
from redis.commands.core import Script

VERSION = 2

# Key names are spelled out here rather than taken from conductor/redis_contract/keys.py: a migration moves
# one fixed layout to the next and must not follow later renames.
GROUP = "workers"
# Only keys of this exact shape are lanes: lane:<sig 16 hex>:<epoch>:<lane id>.
_LANE_TAIL = re.compile(r"^[0-9a-f]{16}:\d+:\d+$")

# Builds an item record exactly as the schema-2 submit.lua does: the id and job through cjson,
# the numbers as integers, and the body's own text after its '[' (so the payload keeps its
# bytes). A body submit.lua would refuse today (leading whitespace, more than two elements)
# is re-encoded from its first two elements instead.
_RECORD_LUA = r"""
local function record(id, job, tok, mt, body)
  local head = '[' .. cjson.encode(id) .. ',' .. cjson.encode(job) .. ',' .. tok .. ',' .. mt .. ','
  local ok, dec = pcall(cjson.decode, body)
  if not ok or type(dec) ~= 'table' or type(dec[1]) ~= 'string' then
    error('ERR_MIGRATE item ' .. id .. ': body is not a JSON array [prompt, payload]')
  end
  if string.byte(body, 1) == 91 and #dec <= 2 then
    return head .. string.sub(body, 2)
  end
  local payload = dec[2]
  if payload == nil then payload = cjson.null end
  return head .. cjson.encode(dec[1]) .. ',' .. cjson.encode(payload) .. ']'
end
"""

# KEYS[1] lane, KEYS[2] its token list. Returns the items moved, or -1 when the lane is not a
# stream any more (converted by an earlier run).
_LANE_LUA = _RECORD_LUA + r"""
local lane, tokkey = KEYS[1], KEYS[2]
if redis.call('TYPE', lane)['ok'] ~= 'stream' then return -1 end
local recs, toks = {}, {}
local start = '-'
while true do
  local entries = redis.call('XRANGE', lane, start, '+', 'COUNT', 1000)
  if #entries == 0 then break end
  for _, e in ipairs(entries) do
    local f = {}
    for j = 1, #e[2], 2 do f[e[2][j]] = e[2][j + 1] end
    local tok, mt = tonumber(f.tok), tonumber(f.mt)
    if not (f.id and f.job and tok and mt and f.d) then
      return redis.error_reply('ERR_MIGRATE ' .. lane .. ' entry ' .. e[1] .. ': not a schema-1 lane entry')
    end
    recs[#recs + 1] = record(f.id, f.job, tok, mt, f.d)
    toks[#toks + 1] = tok
  end
  start = '(' .. entries[#entries][1]
end
redis.call('DEL', lane, tokkey)
-- unpack() is bounded by the Lua C stack: push in slices.
for i = 1, #recs, 1000 do
  local j = math.min(i + 999, #recs)
  redis.call('RPUSH', lane, unpack(recs, i, j))
  redis.call('RPUSH', tokkey, unpack(toks, i, j))
end
return #recs
"""

# Shared by the two scripts below: items of a schema-1 batch blob [sig, ep, lane, plen, mt, ts,
# flags, items] (item = [id, job, tok, mt, body, deliveries]) to a schema-2 reclaimed entry
# [sig, ep, lane, deliveries, [tokens], [records]] whose deliveries is dv.
_ENTRY_LUA = _RECORD_LUA + r"""
local function max_dv(items)
  local dv = 1
  for _, it in ipairs(items) do
    if (it[6] or 1) > dv then dv = it[6] end
  end
  return dv
end

local function entry(b, items, dv)
  local toks, recs = {}, {}
  for _, it in ipairs(items) do
    toks[#toks + 1] = it[3]
    recs[#recs + 1] = record(it[1], it[2], it[3], it[4], it[5])
  end
  return cmsgpack.pack({b[1], b[2], b[3], dv, toks, recs})
end
"""

# KEYS[1] batches, KEYS[2] state, KEYS[3] reclaimed, KEYS[4] base; ARGV[1] batch id.
# Returns the items moved to reclaimed, or -1 for a schema-2 batch (left pending).
# As lib_requeue.lua does for a schema-2 batch: a reclaimed entry carries the delivery count its
# next claim will be (one more than the batch's), and items delivered 3 or more times travel
# alone. Nothing is dead-lettered: stopping the workers for a migration is no item's fault.
_BATCH_LUA = _ENTRY_LUA + r"""
local batches, state, reclaimed, base = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local bid = ARGV[1]
local e = redis.call('XRANGE', batches, bid, bid)[1]
local f = {}
if e then for j = 1, #e[2], 2 do f[e[2][j]] = e[2][j + 1] end end
if e and not f.b then return -1 end
if redis.call('XACK', batches, 'workers', bid) == 0 then return 0 end
redis.call('XDEL', batches, bid)
redis.call('HINCRBY', state, 'inflight_batches', -1)
-- Acked but its entry gone: nothing left to requeue (lib_requeue.lua did the same).
if not e then return 0 end
local b = cmsgpack.unpack(f.b)
redis.call('HINCRBY', state, 'inflight_items', -(tonumber(f.n) or #b[8]))
local keep = {}
for _, it in ipairs(b[8]) do
  if redis.call('HGET', base .. ':job:' .. it[2] .. ':items', it[1]) == 'q' then keep[#keep + 1] = it end
end
if #keep == 0 then return 0 end
local dv = max_dv(keep) + 1
if dv >= 3 then
  for _, it in ipairs(keep) do redis.call('RPUSH', reclaimed, entry(b, {it}, dv)) end
else
  redis.call('RPUSH', reclaimed, entry(b, keep, dv))
end
redis.call('HINCRBY', state, 'reclaimed_items', #keep)
return #keep
"""

# KEYS[1] reclaimed; ARGV[1] index. Returns 1 when the entry was rewritten, 0 when it already
# was in the new format (or the list got shorter). Schema-1 reclaim already counted the next
# delivery into each item, and the new entry has one count for all: the highest.
_RECLAIMED_LUA = _ENTRY_LUA + r"""
local raw = redis.call('LINDEX', KEYS[1], ARGV[1])
if not raw then return 0 end
local ok, b = pcall(cmsgpack.unpack, raw)
if not ok or type(b) ~= 'table' then
  return redis.error_reply('ERR_MIGRATE reclaimed entry ' .. ARGV[1] .. ': not msgpack')
end
if #b ~= 8 or type(b[8]) ~= 'table' then return 0 end
redis.call('LSET', KEYS[1], ARGV[1], entry(b, b[8], max_dv(b[8])))
return 1
"""


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def up(client: redis.Redis) -> None:
    lane_script = client.register_script(_LANE_LUA)
    batch_script = client.register_script(_BATCH_LUA)
    reclaimed_script = client.register_script(_RECLAIMED_LUA)
    for model in sorted(_s(m) for m in client.smembers("cdr:models")):
        base = f"cdr:{{{model}}}"
        _lanes(client, lane_script, base)
        _reclaimed(client, reclaimed_script, base)
        _pending(client, batch_script, base)


def _lanes(client: redis.Redis, script: Script, base: str) -> None:
    prefix = f"{base}:lane:"
    # Collected before converting: a key converted during the scan reappears as a list.
    keys = [_s(k) for k in client.scan_iter(match=_glob_escape(prefix) + "*", count=1000, _type="stream")]
    for key in sorted(keys):
        tail = key[len(prefix):]
        if _LANE_TAIL.match(tail):
            script(keys=[key, f"{base}:lanetok:{tail}"])


def _reclaimed(client: redis.Redis, script: Script, base: str) -> None:
    key = f"{base}:reclaimed"
    for i in range(client.llen(key)):
        script(keys=[key], args=[i])


def _pending(client: redis.Redis, script: Script, base: str) -> None:
    batches = f"{base}:batches"
    keys = [batches, f"{base}:state", f"{base}:reclaimed", base]
    start = "-"
    while True:
        try:
            rows = client.xpending_range(batches, GROUP, min=start, max="+", count=500)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                return
            raise
        if not rows:
            return
        for row in rows:
            script(keys=keys, args=[row["message_id"]])
        start = "(" + _s(rows[-1]["message_id"])
