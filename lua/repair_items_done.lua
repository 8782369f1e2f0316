#!lua flags=allow-oom
-- allow-oom: repairing must work on a full Redis, which drains. The shebang also makes a cluster
-- node refuse any key outside the slot of the model's hash tag.
-- repair_items_done.lua: take the items that have a result out of a lane of a live shape instance
-- (conductor inspect --verify --repair, conductor/verify/repair.py repair_items; a cancel's
-- answered items, conductor/jobs/job_state.py withdraw). Not a hot path: every item of the lane is
-- read and decoded inside the call.
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] state      cdr:{model}:state
-- ARGV[1] lane       "S:E:L": the lane cdr:{model}:lane:S:E:L of the instance cdr:{model}:inst:S:E
-- Returns: {0, cleared, left}: 0 moved (the shape of repair_items_batch.lua's reply), items taken
--   out because they have a result, items left in the lane.
-- Errors, with nothing written: 'ERR_ARG ...'; 'ERR_STATE ...' when the instance is gone (use
--   repair_items_lane.lua), the lane and its token list differ in length, or a record does not
--   decode; 'NOPERM ...' when the caller's ACL refuses a command this call may run (lib.lua
--   acl_refused); 'PAUSED ...'.
-- Invariants: only the items with a result leave the lane, from the lane and its token list at the
--   same positions (the two stay the same length, in order); the lane's meta, the instance's and the
--   model's waiting counters (M:intake) move with them. Fill and ready scores are recounted by
--   repair.lua, which the caller runs next. Everything is read before the first write.
--@include lib.lua
--@include lib_repair_items.lua

local base, state_key = KEYS[1], KEYS[2]
if #ARGV ~= 1 then return redis.error_reply('ERR_ARG argv: expected 1 argument, got ' .. #ARGV) end
local where = ARGV[1]
local sig, ep, lane = string.match(where, '^(%x+):(%d+):(%d+)$')
if not sig or #sig ~= 16 or #ep > 15 or #lane > 15 then
  return redis.error_reply('ERR_ARG lane: must be "S:E:L" (a signature, an epoch and a lane id)')
end

local ik = base .. ':inst:' .. sig .. ':' .. ep
local lk, tk, mk = base .. ':lane:' .. where, base .. ':lanetok:' .. where, base .. ':lanemeta:' .. where
local intake_key = base .. ':intake'
local refused = acl_refused(function(ok)
  return place_ok(ok, base, state_key, lk, tk) and ok('EXISTS', ik) and ok('LSET', lk) and ok('LREM', lk)
    and ok('LSET', tk) and ok('LREM', tk) and ok('HINCRBY', mk) and ok('HINCRBY', ik) and ok('HINCRBY', intake_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

if redis.call('EXISTS', ik) == 0 then
  return redis.error_reply('ERR_STATE lane: instance ' .. sig .. ':' .. ep .. ' is gone (repair_items_lane.lua)')
end
local items, err = place_items(base, lk, tk, false)
if not items then return err end

-- Blanked at their positions, then removed: both lists lose the same items.
local drop, n, tokens = items.drop, #items.drop, items.drop_tokens
if n > 0 then
  for _, i in ipairs(drop) do
    redis.call('LSET', lk, i - 1, '')
    redis.call('LSET', tk, i - 1, '')
  end
  redis.call('LREM', lk, 0, '')
  redis.call('LREM', tk, 0, '')
  for _, key in ipairs({mk, ik, intake_key}) do
    redis.call('HINCRBY', key, 'items', -n)
    redis.call('HINCRBY', key, 'tokens', -tokens)
  end
end
return {0, n, #items.stay}
