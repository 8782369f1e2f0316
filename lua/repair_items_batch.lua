#!lua flags=allow-oom
-- allow-oom: repairing must work on a full Redis, which drains. The shebang also makes a cluster
-- node refuse any key outside the slot of the model's hash tag.
-- repair_items_batch.lua: put back the items of a batch list no pending batch names (a claim or a
-- reclaim that stopped halfway), and delete the leaked batches entry that named it (conductor
-- inspect --verify --repair; conductor/verify/repair.py repair_items). An operator's tool, not a
-- hot path: every item of the list is read and decoded inside the call.
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] state      cdr:{model}:state
-- KEYS[3] batches    cdr:{model}:batches   (group "workers")
-- KEYS[4] reclaimed  cdr:{model}:reclaimed
-- ARGV[1] token      the list cdr:{model}:bat:<token>
-- ARGV[2] sig, ARGV[3] epoch, ARGV[4] lane, ARGV[5] deliveries: the shape instance and lane its
--                    items came from (a batches entry that names the token, or the model's only
--                    signature, epoch and lane 0)
-- ARGV[6] entry      the id of that batches entry, or '': deleted when it is not pending
-- Returns: {moved, cleared, left}: items moved to the reclaimed list (entries of their shape of at
--   most 256 items, served first), items dropped because they have a result already, items left
--   in the list because no job of this model knows them (a human must look).
-- Errors, with nothing written: 'ERR_ARG ...'; 'ERR_STATE ...' when a pending batch names the
--   token or the entry is pending, or a record does not decode; 'NOPERM ...' when the caller's ACL
--   refuses a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariants: an item without a result leaves the list only for the reclaimed list, with its record
--   as it is; an item with a result is dropped; the model's reclaimed_items counter moves with the
--   items it counts. Everything is read before the first write.
--@include lib.lua
--@include lib_repair_items.lua

local base, state_key, batches_key, reclaimed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if #ARGV ~= 6 then return redis.error_reply('ERR_ARG argv: expected 6 arguments, got ' .. #ARGV) end
local token, sig, entry_id = ARGV[1], ARGV[2], ARGV[6]
local ep, lane, dv = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if not token_ok(token) then
  return redis.error_reply('ERR_ARG token: must be 1..' .. RULES.TOKEN_MAX .. ' characters from A-Z a-z 0-9 . _ -')
end
if not hex_ok(sig, RULES.SIG_HEX) then
  return redis.error_reply('ERR_ARG sig: must be 16 lowercase hex digits')
end
if not int_in(ep, 0, 1e15) or not int_in(lane, 0, 1e15) or not int_in(dv, 1, 1e9) then
  return redis.error_reply('ERR_ARG epoch, lane, deliveries: must be whole numbers')
end
if entry_id ~= '' and not stream_id_ok(entry_id) then
  return redis.error_reply('ERR_ARG entry: must be a stream id or empty')
end

local lk = base .. ':bat:' .. token
local refused = acl_refused(function(ok)
  return place_ok(ok, base, state_key, lk, nil) and ok('HGET', base .. ':in:0:sums') and ok('XPENDING', batches_key)
    and ok('XRANGE', batches_key) and ok('XDEL', batches_key) and ok('DEL', lk) and ok('RPUSH', lk)
    and ok('RPUSH', reclaimed_key) and ok('HINCRBY', state_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

-- The list must be orphaned, and the entry not pending, read in this call.
for _, p in ipairs(redis.call('XPENDING', batches_key, GROUP, '-', '+', 100000)) do
  local e = redis.call('XRANGE', batches_key, p[1], p[1])[1]
  if e then
    for j = 1, #e[2], 2 do
      if e[2][j] == 'k' and e[2][j + 1] == token then
        return redis.error_reply('ERR_STATE token: pending batch ' .. p[1] .. ' names ' .. token)
      end
    end
  end
  if p[1] == entry_id then return redis.error_reply('ERR_STATE entry: ' .. entry_id .. ' is pending') end
end
local items, err = place_items(base, lk, nil, true)
if not items then return err end

keep_stays(lk, nil, items)
requeue_kept(reclaimed_key, state_key, sig, ep, lane, dv, items)
if entry_id ~= '' then redis.call('XDEL', batches_key, entry_id) end
return {#items.keep, #items.drop, #items.stay}
