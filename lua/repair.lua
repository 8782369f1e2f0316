#!lua flags=allow-oom
-- allow-oom: repairing counters must work on a full Redis, which drains. The shebang also makes a cluster node
-- refuse any key outside the slot of the model's hash tag.
-- repair.lua: rewrite one shape instance's counters from its lanes' token lists (conductor
-- inspect --verify --repair; conductor/verify/repair.py). An operator's tool, not a hot path: it reads
-- every token of the instance's lanes inside one call (never the item records: the token list
-- M:lanetok:S:E:L is what claim.lua packs from; verify.py checks it against the records).
--
-- KEYS[1] base    cdr:{model}
-- KEYS[2] cfg     cdr:{model}:cfg
-- KEYS[3] state   cdr:{model}:state   (read only here: the model's counters are rewritten after
--                                      every instance, as the sum of the instances, by verify.py)
-- ARGV[1] inst    "S:E": signature (hex) and epoch
-- ARGV[2..]       lane ids a SCAN found for this instance (lane lists, token lists or metas that
--                 the instance's lanes ZSET may no longer list)
-- Returns: a flat list of changes, 4 strings each: key, field, old value, new value ('' when
--   absent). Errors, with nothing written: 'ERR_ARG inst: ...'; 'ERR_STATE inst: ...' when
--   lanes hold items but the instance hash is gone (a human must decide where they belong);
--   'ERR_STATE lane: ...' when a lane list and its token list differ in length (which token
--   belongs to which item is then unknown: a human must decide); 'NOPERM ...' when the caller's
--   ACL refuses a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: afterwards each lane's meta items equal its length and its meta tokens the sum of
--   its token list, its rep bounds its longest token and scores it in the lanes ZSET, fill
--   scores exactly the non-empty lanes with their weight, ready holds exactly the lanes with a
--   full batch under the current config, no lane in use is in the free set, the instance's
--   tokens and items are the sum of its lanes, a staged or warming instance (only those) is
--   scored in the staged ZSET with its tokens, and the instance's index version (lib.lua
--   index_version) names the current config. Item records and token lists are never moved.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua
--@include lib_lane_truth.lua
--@include lib_repair.lua

local base, cfg_key = KEYS[1], KEYS[2]
local inst = ARGV[1]
if not inst or not string.match(inst, '^%x+:%d+$') then
  return redis.error_reply('ERR_ARG inst: must be a shape instance "S:E"')
end
for i = 2, #ARGV do
  if not string.match(ARGV[i], '^%d+$') then return redis.error_reply('ERR_ARG lane: must be a lane id') end
end
local ik = base .. ':inst:' .. inst
local lp = ':' .. inst .. ':0'
local refused = acl_refused(function(ok)
  for _, z in ipairs({ik .. ':lanes', ik .. ':fill', ik .. ':ready', base .. ':staged'}) do
    if not (ok('ZRANGE', z) and ok('ZSCORE', z) and ok('ZADD', z) and ok('ZREM', z)) then return false end
  end
  local mk = base .. ':lanemeta' .. lp
  return ok('HGET', KEYS[3]) and ok('HMGET', cfg_key) and ok('EXISTS', ik) and ok('HGET', ik) and ok('HSET', ik)
    and ok('HMGET', ik) and ok('SREM', ik .. ':free') and ok('SADD', ik .. ':free')
    and ok('LLEN', base .. ':lane' .. lp) and ok('LRANGE', base .. ':lanetok' .. lp) and ok('HMGET', mk)
    and ok('HSET', mk) and ok('HSETNX', mk) and ok('TIME')
end)
if refused then return refused end
refused = paused(KEYS[3])
if refused then return refused end
local rp = {base = base, ik = ik, inst = inst, cfg = load_cfg(cfg_key), now = now_ms(), out = {}}

local lanes, seen = {}, {}
local function add(lane)
  if not seen[lane] then
    seen[lane] = true
    lanes[#lanes + 1] = lane
  end
end
for _, z in ipairs({':lanes', ':fill', ':ready'}) do
  for _, lane in ipairs(redis.call('ZRANGE', ik .. z, 0, -1)) do add(lane) end
end
for i = 2, #ARGV do add(ARGV[i]) end

-- Truth first, so an instance that cannot be repaired is refused before the first write.
local truth, total_tok, total_items = lane_truth(base, inst, lanes)
if not truth then return total_tok end
local exists = redis.call('EXISTS', ik) == 1
if not exists and total_items > 0 then
  return redis.error_reply('ERR_STATE inst: ' .. inst .. ' is gone but its lanes hold ' .. total_items ..
    ' items (' .. total_tok .. ' tokens)')
end

rp.exists = exists
for _, lane in ipairs(lanes) do repair_lane(rp, lane, truth[lane]) end
repair_inst(rp, total_tok, total_items)
return rp.out
