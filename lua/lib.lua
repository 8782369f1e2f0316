-- lib.lua: helpers shared by the conductor's scripts, inlined where a script says
-- "--@include lib.lua" (conductor/redis_contract/scripts.py). CFG_NAMES, CFG_DEFAULTS, GROUP, RULES,
-- name_ok, is_request, result_record and RESULT_INT come from lib_generated.lua, which
-- conductor/redis_contract/lua_generated.py writes from the Python homes of those rules; key
-- suffixes follow conductor/redis_contract/keys.py (tests/test_keys.py checks).

-- A JSON string literal, as cjson.encode writes it; plain names (the usual ids and jobs) skip
-- the encoder, whose call costs about a microsecond per item.
local function json_str(v)
  if not string.find(v, '[%c"\\/\128-\255]') then return '"' .. v .. '"' end
  return cjson.encode(v)
end

-- After json_str: the generated result builder calls it.
--@include lib_generated.lua

-- names: the fields a script uses (every field when nil); each field read costs, and claim.lua
-- runs once per batch.
local function load_cfg(cfg_key, names)
  names = names or CFG_NAMES
  local raw = redis.call('HMGET', cfg_key, unpack(names))
  local cfg = {}
  -- a numeric loop: ipairs' iterator is a C call a field (every script loads its config)
  for i = 1, #names do
    local name, v = names[i], raw[i]
    if v then
      if name ~= 'mode' then v = tonumber(v) or CFG_DEFAULTS[name] end
      cfg[name] = v
    else
      cfg[name] = CFG_DEFAULTS[name]
    end
  end
  return cfg
end

-- A hash's fields read by name into a table (false where a field is missing): one HMGET, and
-- the callers say st.gate rather than st[1].
local function hmget_named(key, names)
  local raw = redis.call('HMGET', key, unpack(names))
  local out = {}
  for i = 1, #names do out[names[i]] = raw[i] end
  return out
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- n rounded up to a multiple of 8: Lua's % is floored, so n + (-n) % 8 is ceil(n / 8) * 8 without
-- math.ceil's C call (about 500 instructions; claim calls it a dozen times a batch).
local function pad8(n)
  return n + (-n) % 8
end

-- Tokens a lane counts against a budget: memory mode pads every item to the lane's
-- representative length rounded up to 8 (the rep bounds every item: lanes only grow).
local function lane_weight(cfg, items, tokens, rep)
  if cfg.mode == 'disk' then return tokens end
  return items * pad8(rep)
end

local function lane_is_ready(cfg, items, tokens, rep)
  return items >= cfg.budget_items or lane_weight(cfg, items, tokens, rep) >= cfg.budget_tokens
end

local function num(v)
  return tonumber(v) or 0
end

-- Argument check shared by every script: a whole number within lo..hi (nil and NaN fail).
local function int_in(v, lo, hi)
  return v ~= nil and v >= lo and v <= hi and v == math.floor(v)
end

-- The fill and ready indices of a shape instance are derived under one reference contract and
-- mode; when those change (the first worker registers after items wait, an operator switches
-- mode) the instance's indices are re-derived before it is served (claim.lua).
-- 'v2': the fill index scores a lane by its rep (the order the neighbour fill walks), no longer
-- by its weight; instances indexed before are re-derived when next served.
local function index_version(cfg)
  return 'v2:' .. cfg.budget_tokens .. ':' .. cfg.budget_items .. ':' .. cfg.mode
end


-- Re-derive fill scores and ready membership of every lane of one shape instance (bounded by
-- lane_max lanes); claim.lua calls it lazily, reindex.lua eagerly after a config change.
local function reindex(base, state_key, cfg, inst)
  local ik = base .. ':inst:' .. inst
  redis.call('DEL', ik .. ':ready', ik .. ':fill')
  for _, lane in ipairs(redis.call('ZRANGE', ik .. ':lanes', 0, -1)) do
    local m = redis.call('HMGET', base .. ':lanemeta:' .. inst .. ':' .. lane, 'items', 'tokens', 'rep')
    local items, tokens, rep = num(m[1]), num(m[2]), num(m[3])
    if items > 0 then
      redis.call('ZADD', ik .. ':fill', rep, lane)
      if lane_is_ready(cfg, items, tokens, rep) then redis.call('ZADD', ik .. ':ready', lane, lane) end
    end
  end
  redis.call('HSET', ik, 'idx', index_version(cfg))
  redis.call('HINCRBY', state_key, 'reindexes', 1)
end

-- The item record (conductor/redis_contract/records.py): JSON [id, job, input_tokens, max_tokens, prompt, payload].
-- body must be a JSON array [prompt] or [prompt, payload] starting at its first byte (submit.lua
-- checks it): it supplies the record's tail as it is, so the payload keeps its bytes.
local function item_record(id, job, tok, mt, body)
  return '[' .. json_str(id) .. ',' .. json_str(job) .. ',' .. tok .. ',' .. tonumber(mt) .. ',' ..
    string.sub(body, 2)
end

-- Paused (conductor pause MODEL): a script that writes checks this before its first write and
-- refuses, so a model's keys can move between cluster nodes, or be migrated, while nothing is
-- half-written. Returns the error reply to return, or nil.
local function paused(state_key)
  if redis.call('HGET', state_key, 'paused') == '1' then
    return redis.error_reply('PAUSED the model is paused, nothing written (conductor resume MODEL)')
  end
  return nil
end

-- ACL pre-check. ACL rules apply to every command a script calls, under the calling user, and a
-- script does not roll back: a command refused after a write would leave that write behind. Every
-- writing script calls this after its argument checks and before its first write. checks(ok)
-- names each command the script may call in this call, with the keys it may call it on, as a chain
-- ok('HSET', key) and ok('DEL', k1, k2) and ... (ok is redis.acl_check_cmd; subcommands as in
-- ok('XGROUP', 'DELCONSUMER', key)). Keys named per shape instance, lane, batch or job are checked
-- by one name of their pattern, so the cost is one check per distinct command and key pattern
-- (figure: bench/RESULTS.md), not per key or item; the chain builds no table. Returns the error
-- reply to return ('NOPERM ...', naming the first refused command; nothing written), or nil.
local function acl_refused(checks)
  local check = redis.acl_check_cmd
  if checks(check) then return nil end
  local which = {}
  checks(function(...)
    if check(...) then return true end
    which = {...}
    return false
  end)
  return redis.error_reply('NOPERM this user has no permissions to run ' .. table.concat(which, ' ') ..
    ', which this script may need: nothing written')
end

-- A stream id Redis takes: <ms>-<seq>, both whole numbers below 2^64, at most 127 bytes. The pattern alone passes
-- 99999999999999999999999-0, which XRANGE and XACK refuse (after writes, if nothing checked).
local U64_MAX = '18446744073709551615'
local function u64_ok(s)
  s = string.gsub(s, '^0+(%d)', '%1')
  return #s < 20 or (#s == 20 and s <= U64_MAX)
end
local function stream_id_ok(id)
  if type(id) ~= 'string' or #id > 127 then return false end
  local ms, seq = string.match(id, '^(%d+)%-(%d+)$')
  return ms ~= nil and u64_ok(ms) and u64_ok(seq)
end

-- The consumer a worker's script acts for: the error reply naming it, or nil.
local function consumer_bad(consumer)
  if (not consumer) or #consumer < 1 or #consumer > 200 then
    return redis.error_reply('ERR_ARG consumer: must be 1..200 bytes')
  end
  return nil
end
-- A batch its consumer names (fail.lua, hand_over.lua): the error reply for the first bad field, or nil.
local function batch_ref_bad(bid, consumer)
  if not stream_id_ok(bid) then
    return redis.error_reply('ERR_ARG batch_id: must be a stream id like 1700000000000-0')
  end
  return consumer_bad(consumer)
end

-- Two valid stream ids compared: -1, 0 or 1 (the parts may pass 2^53: compared as digit strings).
local function id_cmp(a, b)
  local am, as = string.match(a, '^0*(%d-)%-0*(%d-)$')
  local bm, bs = string.match(b, '^0*(%d-)%-0*(%d-)$')
  for _, p in ipairs({{am, bm}, {as, bs}}) do
    local x, y = p[1], p[2]
    if #x ~= #y then return #x < #y and -1 or 1 end
    if x ~= y then return x < y and -1 or 1 end
  end
  return 0
end

-- The disk tier's store-waiting tokens of one shape (issue 37): field stored_tokens of M:shape:S, S
-- the signature whose instances its items join (qualified by the job's class). Moved wherever
-- M:intake stored_tokens moves (register_segment.lua, lib_place.lua, fail_stored.lua); absent
-- means 0, and a count that would go below 0 (segments registered before the field was kept) stays
-- at 0, so a shape only ever reads as having stored work when it has. (HSET, not HDEL: a producer
-- may not delete, deploy/redis/users.acl.)
local function shape_stored_add(base, shape, delta)
  if delta == 0 then return end
  local key = base .. ':shape:' .. shape
  if redis.call('HINCRBY', key, 'stored_tokens', delta) < 0 then redis.call('HSET', key, 'stored_tokens', 0) end
end
