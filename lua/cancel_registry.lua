#!lua flags=allow-oom
-- allow-oom: cancelling frees work and must run on a full Redis, which drains.
-- cancel_registry.lua: one bounded step of cancelling (or expiring) a job on one model, over its id
-- registry (conductor cancel; conductor/jobs/job_state.py cancel_model). Each call walks at most
-- about `count` entries of the registry from `cursor` (HSCAN) and gives every waiting item of them an
-- error result, with input_tokens 0 and payload null (cancel_lane.lua answers the items of the lanes
-- first, with theirs); the caller loops until the cursor comes back '0'. Items in flight are left
-- alone: their batch finishes and its results are kept (complete.lua). The items stay in their
-- lanes, answered; lua/repair_items_done.lua then takes them out (job_state.py withdraw).
--
-- KEYS[1] base     cdr:{model}             (pending batches' items lists: base .. ':bat:' .. token)
-- KEYS[2] state    cdr:{model}:state
-- KEYS[3] batches  cdr:{model}:batches     (group "workers")
-- KEYS[4] job      the job's counters for this model (keys.py ModelKeys.job)
-- KEYS[5] items    the job's done marks (keys.py ModelKeys.job_items): id -> d
-- KEYS[6] results  the job's results stream (keys.py ModelKeys.job_results)
-- KEYS[7] registry the job's id registry (keys.py ModelKeys.job_sums): every id submitted
-- ARGV[1] job      the job name (written into each result)
-- ARGV[2] model    the model name (written into each result)
-- ARGV[3] code     the results' error code: 'cancelled' or 'expired'
-- ARGV[4] message  the results' error message, at most 1,000 bytes
-- ARGV[5] cursor   HSCAN cursor ('0' to start)
-- ARGV[6] count    HSCAN COUNT, 1..10000
-- Returns: {next cursor, items answered now, items skipped because in flight}.
-- Errors, with nothing written: 'ERR_ARG <field>: ...'; 'NOPERM ...' when the caller's ACL refuses
--   a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: lib_cancel.lua's: every waiting item answered once, none in flight; every read before
--   the first write.
--@include lib.lua
--@include lib_cancel.lua

local cx, err = cancel_args(KEYS, ARGV, 6)
if not cx then return err end
local registry_key, cursor, count = KEYS[7], ARGV[5], tonumber(ARGV[6])
if #cursor > 20 or not string.match(cursor, '^%d+$') or not u64_ok(cursor) then
  return redis.error_reply('ERR_ARG cursor: must be an HSCAN cursor (a whole number below 2^64)')
end
if not int_in(count, 1, 10000) then return redis.error_reply('ERR_ARG count: must be an integer in 1..10000') end
local refused = cancel_refused(cx, function(ok) return ok('HSCAN', registry_key) end)
if refused then return refused end

local page = redis.call('HSCAN', registry_key, cursor, 'COUNT', count)
local page_ids, flat = {}, page[2]
for j = 1, #flat, 2 do page_ids[#page_ids + 1] = flat[j] end
local ids, skipped = cancel_unanswered(cx, page_ids)
if not ids then return skipped end
return {page[1], cancel_answer(cx, ids, {}), skipped}
