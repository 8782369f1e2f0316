"""Schema 4: what claim.lua and dead_retry.lua converted inline on every call moves here, run once.

Stop every worker and producer before ``conductor migrate``.

Per model (``SMEMBERS cdr:models``, ``M`` = ``cdr:{model}``, layout in conductor/redis_contract/keys.py):

* ``M:state`` field ``active`` (the one active instance, from before several could be active)
  joins the zset ``M:active`` (scored with the server's time, as claim.lua did; an instance
  listed there already keeps its activation time) and leaves ``M:state``;
* dead letters written under key schema 1 hold the item's body (field ``d``) instead of its item
  record (``it``): each gets its record, built as dead_retry.lua built it (a body with leading
  space or a third element re-encoded from its first two elements, as migrations/0002 does). A
  stream entry cannot change in place, so the stream is copied page by page into ``M:dead:v4``
  under the same entry ids, then renamed over ``M:dead`` in the step that copies the last page.
  An entry whose body does not decode is copied as it is: dead_retry.lua refuses it as before.

Each step is one Lua call (a model's state, one page of its dead letters), so a crash midway
leaves each step old or new, and running ``up`` again finishes what is left: the copy goes on
after the last id ``M:dead:v4`` holds.
"""

from __future__ import annotations

import redis

VERSION = 4

# Key names are spelled out here rather than taken from conductor/redis_contract/keys.py: a
# migration moves one fixed layout to the next and must not follow later renames.
PAGE = 500

# KEYS[1] state, KEYS[2] active zset.
_ACTIVE_LUA = r"""
local inst = redis.call('HGET', KEYS[1], 'active')
if inst and inst ~= '' then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[2], 'NX', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), inst)
end
if inst then redis.call('HDEL', KEYS[1], 'active') end
return 1
"""

# KEYS[1] dead, KEYS[2] the copy; ARGV[1] page size. Returns 1 once the copy replaced the stream.
_DEAD_LUA = r"""
local dead, copy, page = KEYS[1], KEYS[2], tonumber(ARGV[1])
local function json_str(v)
  if not string.find(v, '[%c"\\/\128-\255]') then return '"' .. v .. '"' end
  return cjson.encode(v)
end
local last = redis.call('XREVRANGE', copy, '+', '-', 'COUNT', 1)[1]
local entries = redis.call('XRANGE', dead, last and ('(' .. last[1]) or '-', '+', 'COUNT', page)
for _, e in ipairs(entries) do
  local f, out = {}, {}
  for j = 1, #e[2], 2 do f[e[2][j]] = e[2][j + 1] end
  local rec
  if not f.it and f.d and f.id and f.job then
    local body = f.d
    local ok, dec = pcall(cjson.decode, body)
    local tok, mt = tonumber(f.tok), tonumber(f.mt)
    if ok and type(dec) == 'table' and tok and mt then
      if string.byte(body, 1) ~= 91 or #dec > 2 then
        body = cjson.encode({dec[1], dec[2] == nil and cjson.null or dec[2]})
      end
      rec = '[' .. json_str(f.id) .. ',' .. json_str(f.job) .. ',' .. tok .. ',' .. mt .. ',' .. string.sub(body, 2)
    end
  end
  for j = 1, #e[2], 2 do
    local k = e[2][j]
    if not (rec and k == 'd') then
      out[#out + 1] = k
      out[#out + 1] = e[2][j + 1]
    end
  end
  if rec then
    out[#out + 1] = 'it'
    out[#out + 1] = rec
  end
  redis.call('XADD', copy, e[1], unpack(out))
end
if #entries == page then return 0 end
-- The last page: the copy takes the stream's last generated id (entries deleted at its end
-- included), so new entries get later ids than any the stream gave before, and its name.
local info = redis.call('XINFO', 'STREAM', dead)
for j = 1, #info, 2 do
  if info[j] == 'last-generated-id' then
    if redis.call('EXISTS', copy) == 1 then redis.call('XSETID', copy, info[j + 1]) end
  end
end
if redis.call('EXISTS', copy) == 1 then redis.call('RENAME', copy, dead) end
return 1
"""


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _needs_copy(client: redis.Redis, dead: str) -> bool:
    """Whether a dead-letter stream holds an entry of schema 1 (a body, no item record)."""
    cursor = "-"
    while True:
        page = client.xrange(dead, min=cursor, count=PAGE)
        for _eid, f in page:
            if b"it" not in f and b"d" in f:
                return True
        if len(page) < PAGE:
            return False
        cursor = "(" + _s(page[-1][0])


def up(client: redis.Redis) -> None:
    active = client.register_script(_ACTIVE_LUA)
    dead_copy = client.register_script(_DEAD_LUA)
    for model in sorted(_s(m) for m in client.smembers("cdr:models")):
        base = f"cdr:{{{model}}}"
        active(keys=[f"{base}:state", f"{base}:active"])
        dead, copy = f"{base}:dead", f"{base}:dead:v4"
        if not client.exists(copy) and not _needs_copy(client, dead):
            continue
        while not int(dead_copy(keys=[dead, copy], args=[PAGE])):
            pass
