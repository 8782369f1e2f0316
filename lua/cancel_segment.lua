#!lua flags=allow-oom
-- allow-oom: cancelling frees work and must run on a full Redis, which drains.
-- cancel_segment.lua: one step of cancelling (or expiring) a job on one model: the ids of one store
-- segment of the job (its list cdr:{model}:seg:N:ids; schema 6), which wait in no lane and no registry
-- entry, get an error result with input_tokens 0 and payload null (the feeder then drops them
-- unplaced; conductor/jobs/job_state.py cancel_model).
--
-- KEYS[1] base     cdr:{model}             (pending batches' items lists: base .. ':bat:' .. token)
-- KEYS[2] state    cdr:{model}:state
-- KEYS[3] batches  cdr:{model}:batches     (group "workers")
-- KEYS[4] job      the job's counters for this model (keys.py ModelKeys.job)
-- KEYS[5] items    the job's done marks (keys.py ModelKeys.job_items): id -> d
-- KEYS[6] results  the job's results stream (keys.py ModelKeys.job_results)
-- ARGV[1] job      the job name (written into each result)
-- ARGV[2] model    the model name (written into each result)
-- ARGV[3] code     the results' error code: 'cancelled' or 'expired'
-- ARGV[4] message  the results' error message, at most 1,000 bytes
-- ARGV[5] segment  N, 32 hex digits: the segment cdr:{model}:seg:N (answered only if it is the job's)
-- Returns: {'0', items answered now, items skipped because in flight}.
-- Errors, with nothing written: 'ERR_ARG <field>: ...'; 'NOPERM ...' when the caller's ACL refuses
--   a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: lib_cancel.lua's: every waiting item answered once, none in flight; every read before
--   the first write.
--@include lib.lua
--@include lib_cancel.lua

local cx, err = cancel_args(KEYS, ARGV, 5)
if not cx then return err end
local name = ARGV[5]
if not hex_ok(name, RULES.SEGMENT_NAME_HEX) then
  return redis.error_reply('ERR_ARG segment: must be 32 hex digits')
end
local seg_key = cx.base .. ':seg:' .. name
local refused = cancel_refused(cx, function(ok) return ok('HGET', seg_key) and ok('LRANGE', seg_key .. ':ids') end)
if refused then return refused end

local page_ids, once = {}, {}
if redis.call('HGET', seg_key, 'job') == cx.job then
  for _, id in ipairs(redis.call('LRANGE', seg_key .. ':ids', 0, -1)) do
    if not once[id] then
      once[id] = true
      page_ids[#page_ids + 1] = id
    end
  end
end
local ids, skipped = cancel_unanswered(cx, page_ids)
if not ids then return skipped end
return {'0', cancel_answer(cx, ids, {}), skipped}
