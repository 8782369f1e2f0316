#!lua flags=allow-oom
-- allow-oom: cancelling frees work and must run on a full Redis, which drains.
-- cancel_lane.lua: one step of cancelling (or expiring) a job on one model: this job's waiting items
-- of one lane get an error result that carries each item's input tokens and payload, which only its
-- record holds (conductor/jobs/job_state.py cancel_model walks the lanes first, then
-- cancel_segment.lua and cancel_registry.lua answer the rest). Items in flight are left alone; the
-- answered items stay in the lane (lua/repair_items_done.lua takes them out).
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
-- ARGV[5] lane     "S:E:L": the lane cdr:{model}:lane:S:E:L (a signature, an epoch and a lane id)
-- Returns: {'0', items answered now, items skipped because in flight}.
-- Errors, with nothing written: 'ERR_ARG <field>: ...'; 'NOPERM ...' when the caller's ACL refuses
--   a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: lib_cancel.lua's: every waiting item answered once, none in flight; every read before
--   the first write.
--@include lib.lua
--@include lib_cancel.lua
--@include lib_record_parts.lua

local cx, err = cancel_args(KEYS, ARGV, 5)
if not cx then return err end
local where = ARGV[5]
local sig, ep, lane = string.match(where, '^(%x+):(%d+):(%d+)$')
if not sig or #sig ~= 16 or #ep > 15 or #lane > 15 then
  return redis.error_reply('ERR_ARG lane: must be "S:E:L" (a signature, an epoch and a lane id)')
end
local lane_key = cx.base .. ':lane:' .. where
local refused = cancel_refused(cx, function(ok) return ok('LRANGE', lane_key) end)
if refused then return refused end

local page_ids, recs = {}, {}
for _, rec in ipairs(redis.call('LRANGE', lane_key, 0, -1)) do
  local id, rjob, tok, payload = record_parts(rec)
  if rjob == cx.job and id and not recs[id] then
    recs[id] = {tok, payload}
    page_ids[#page_ids + 1] = id
  end
end
local ids, skipped = cancel_unanswered(cx, page_ids)
if not ids then return skipped end
return {'0', cancel_answer(cx, ids, recs), skipped}
