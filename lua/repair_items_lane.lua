#!lua flags=allow-oom
-- allow-oom: repairing must work on a full Redis, which drains. The shebang also makes a cluster
-- node refuse any key outside the slot of the model's hash tag.
-- repair_items_lane.lua: put back the items of a lane whose shape instance is gone (finished), and
-- drop the lane's keys once nothing stays in it (conductor inspect --verify --repair;
-- conductor/verify/repair.py repair_items). An operator's tool, not a hot path: every item of the
-- lane is read and decoded inside the call.
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] state      cdr:{model}:state
-- KEYS[3] reclaimed  cdr:{model}:reclaimed
-- ARGV[1] lane       "S:E:L": the lane cdr:{model}:lane:S:E:L, its token list and its meta
-- Returns: {moved, cleared, left}: items moved to the reclaimed list (entries of their shape of at
--   most 256 items, served first), items dropped because they have a result already, items left
--   in the lane because no job of this model knows them (a human must look).
-- Errors, with nothing written: 'ERR_ARG ...'; 'ERR_STATE ...' when the instance cdr:{model}:inst:S:E
--   exists (lua/repair.lua recounts its lanes), the lane and its token list differ in length, or a
--   record does not decode; 'NOPERM ...' when the caller's ACL refuses a command this call may run
--   (lib.lua acl_refused); 'PAUSED ...'.
-- Invariants: an item without a result leaves the lane only for the reclaimed list, with its record
--   as it is; an item with a result is dropped; the lane and its token list stay the same length; the
--   model's reclaimed_items counter moves with the items it counts. Everything is read before the
--   first write.
--@include lib.lua
--@include lib_repair_items.lua

local base, state_key, reclaimed_key = KEYS[1], KEYS[2], KEYS[3]
if #ARGV ~= 1 then return redis.error_reply('ERR_ARG argv: expected 1 argument, got ' .. #ARGV) end
local where = ARGV[1]
local sig, ep, lane = string.match(where, '^(%x+):(%d+):(%d+)$')
if not sig or #sig ~= 16 or #ep > 15 or #lane > 15 then
  return redis.error_reply('ERR_ARG lane: must be "S:E:L" (a signature, an epoch and a lane id)')
end

local ik = base .. ':inst:' .. sig .. ':' .. ep
local lk, tk, mk = base .. ':lane:' .. where, base .. ':lanetok:' .. where, base .. ':lanemeta:' .. where
local refused = acl_refused(function(ok)
  return place_ok(ok, base, state_key, lk, tk) and ok('HGET', base .. ':in:0:sums') and ok('EXISTS', ik)
    and ok('DEL', lk) and ok('RPUSH', lk) and ok('DEL', tk) and ok('RPUSH', tk) and ok('DEL', tk, mk)
    and ok('RPUSH', reclaimed_key) and ok('HINCRBY', state_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

if redis.call('EXISTS', ik) == 1 then
  return redis.error_reply('ERR_STATE lane: instance ' .. sig .. ':' .. ep .. ' exists (repair.lua recounts its lanes)')
end
local items, err = place_items(base, lk, tk, true)
if not items then return err end

keep_stays(lk, tk, items)
if #items.stay == 0 then redis.call('DEL', tk, mk) end
requeue_kept(reclaimed_key, state_key, sig, tonumber(ep), tonumber(lane), 1, items)
return {#items.keep, #items.drop, #items.stay}
