#!lua flags=allow-oom
-- allow-oom: at maxmemory a full Redis must still drain (this script frees or moves memory); only
-- submit.lua is refused, with QueueFull.
-- complete.lua: write results back idempotently and retire a finished batch.
--
-- KEYS[1] base     cdr:{model}
-- KEYS[2] state    cdr:{model}:state
-- KEYS[3] batches  cdr:{model}:batches   (group "workers")
-- ARGV[1] batch_id   the batches stream id the claim returned
-- ARGV[2] final      1 when this call carries the batch's last results (ack and delete it)
-- ARGV[3] n          number of results that follow
-- ARGV[4..]          4 fields per result: job, item id, status ('ok' | 'err'), result JSON
-- Retiring a batch acks and deletes its entry and deletes its items list (cdr:{model}:bat:<k>).
-- A batch its claim charged to a tenant (entry fields tn, vl) counts its new results' output tokens
--   against their limits in cdr:{model}:vtc_ratio (lib_service.lua, lib_fair.lua out_ratio).
-- Returns: {written, acked}: results written now (a result already written before is skipped)
--   and 1 when this call retired the batch. {0, 0}, with nothing written, when the batch was
--   retired before (by this consumer, or by a reclaim that put its items back in the queue):
--   its items may be running elsewhere, so a late worker's results are not taken.
--   Errors, with nothing written: 'ERR_ARG <field>: ...' for a malformed argument, a batch id the
--   batches stream never issued, or a result for an item that is not in the batch (one still in a
--   lane, one of another batch); 'NOPERM ...' when the caller's ACL refuses a command this call may
--   run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariants: an item's result is written at most once (its state in the job's items hash
--   moves q -> d exactly once; an answered id compacted to M:job:J:packed counts as d), only while
--   the item is in this pending batch's items list, so a batch completed twice, or completed by a
--   slow worker after a reclaim handed it on, never duplicates a result and never marks done an
--   item that waits elsewhere; counters move with the writes. Every argument is checked, and the
--   batch and its items are read, before the first write.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
-- Request jobs (a name starting with rules.py REQUEST_JOB_PREFIX, conductor/client/request.py): each newly
--   written result is also pushed to cdr:{model}:reply:<job>:<id> (a list, expiring after rules.py
--   REPLY_TTL_MS) for the caller blocked on
--   it; written once with the result, so a re-delivered item answers its caller once. The call that
--   writes a job's last result stamps its end (lib_job_end.lua); a request job's never ends.
-- The steps live in includes: lib_complete_guard.lua (checks and reads before the first write),
--   lib_writeback.lua (the results, by job).
--@include lib.lua
--@include lib_complete_guard.lua
--@include lib_writeback.lua

local base, state_key, batches_key = KEYS[1], KEYS[2], KEYS[3]
local bid, final, n, jobs = complete_args(ARGV)
if not bid then return final end
local refused = complete_refused(base, state_key, batches_key, jobs) or paused(state_key)
if refused then return refused end

-- The batch and its items, read before any write.
local count, items_key, charged = complete_batch(base, batches_key, bid, ARGV, n)
if not count then return items_key end
-- XACK below refuses a stream without the group (NOGROUP): that refusal comes here, before any write.
if final == '1' then redis.call('XPENDING', batches_key, GROUP, bid, bid, '1') end
-- Which results are new, read before any write.
local jobs, order = results_by_job(base, ARGV, n)

local written, out_tokens = write_results(base, state_key, jobs, order, ARGV)
-- The output these results report against the limits their claim charged (lib_service.lua).
count_output_ratio(base, charged, written, out_tokens)
local acked = 0
if final == '1' then
  acked = redis.call('XACK', batches_key, GROUP, bid)
  if acked == 1 then
    redis.call('XDEL', batches_key, bid)
    redis.call('HINCRBY', state_key, 'inflight_batches', '-1')
    if items_key then redis.call('DEL', items_key) end
    redis.call('HINCRBY', state_key, 'inflight_items', string.format('%d', -count))
  end
end
return {written, acked}
