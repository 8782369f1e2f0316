-- lib_cancel.lua: what the three steps of cancelling (or expiring) a job on one model share
-- (cancel_registry.lua, cancel_lane.lua, cancel_segment.lua; conductor/jobs/job_state.py): their
-- common arguments and refusals, which of the ids a step looks at are still to answer, and the
-- answers, written as complete.lua writes results.
-- Keys: a step's KEYS[1..6]: M (base), M:state (HGET paused, HINCRBY failed), M:batches, M:job:J
--   (HINCRBY failed and the code's counter, HSET ending), M:job:J:items (HMGET, HSET),
--   M:job:J:results (XADD); through lib_inflight.lua and lib_job_end.lua what they touch.
-- Invariants: cancel_unanswered reads everything (the in-flight ids, the done marks, the end stamp's
--   counters) and cancel_answer only writes, so a step reads all before its first write; an item gets
--   its done mark at most once, with one result record and one count in the job's and the model's
--   'failed' counters and in the job's counter named by the code, so submitted = completed + failed
--   + pending holds after every step; an item in a pending batch is never answered here.
--   Every step sets 'ending' (the code) in the job's counters, so a batch in flight that finishes
--   later stamps the job with it; the step that answers the job's last item stamps its end itself.
--@include lib.lua
--@include lib_job_end.lua
--@include lib_inflight.lua

-- A step's context from its keys and its first four arguments (job, model, code: 'cancelled' or
-- 'expired', message: at most 1,000 bytes), of n arguments in all; or nil and the error reply.
local function cancel_args(keys, argv, n)
  if #argv ~= n then return nil, redis.error_reply('ERR_ARG argv: expected ' .. n .. ' arguments, got ' .. #argv) end
  local cx = {base = keys[1], state_key = keys[2], batches_key = keys[3], job_key = keys[4], items_key = keys[5],
    results_key = keys[6], job = argv[1], model = argv[2], code = argv[3], message = argv[4]}
  if not name_ok(cx.job) then return nil, redis.error_reply('ERR_ARG job: invalid job name') end
  if not name_ok(cx.model) then return nil, redis.error_reply('ERR_ARG model: invalid model name') end
  if not end_code_ok(cx.code) then
    return nil, redis.error_reply('ERR_ARG code: must be cancelled or expired')
  end
  if #cx.message > 1000 then return nil, redis.error_reply('ERR_ARG message: longer than 1000 bytes') end
  return cx
end

-- The refusals before a step's first write: a command the caller's ACL denies (lib.lua acl_refused;
-- step(ok) names the step's own reads), or a paused model. Returns the error reply, or nil.
local function cancel_refused(cx, step)
  local refused = acl_refused(function(ok)
    return ok('HGET', cx.state_key) and ok('HINCRBY', cx.state_key) and inflight_ok(ok, cx.base, cx.batches_key)
      and ok('HMGET', cx.items_key) and ok('HSET', cx.items_key) and ok('XADD', cx.results_key)
      and ok('HINCRBY', cx.job_key) and ok('TIME') and job_end_ok(ok, cx.base, cx.job) and step(ok)
  end)
  return refused or paused(cx.state_key)
end

-- Of the ids a step looks at (page_ids, each once), those without a done mark and not in flight,
-- and how many were skipped because a pending batch holds them; reads the end stamp's counters too.
-- Returns ids, skipped; or nil and the error reply.
local function cancel_unanswered(cx, page_ids)
  local inflight, err = inflight_ids(cx.base, cx.batches_key, cx.job)
  if not inflight then return nil, err end
  local ids, skipped = {}, 0
  for s = 1, #page_ids, 2000 do
    local marks = redis.call('HMGET', cx.items_key, unpack(page_ids, s, math.min(s + 1999, #page_ids)))
    for j = 1, #marks do
      local id = page_ids[s + j - 1]
      if marks[j] ~= 'd' then
        if inflight[id] then skipped = skipped + 1 else ids[#ids + 1] = id end
      end
    end
  end
  cx.ends = job_end_read(cx.base, cx.job)
  return ids, skipped
end

-- The writes: per id one result (lib_generated.lua result_record), one done mark and one failed
-- count; recs[id] = {input tokens, payload's JSON text} where the step read the item's record, else
-- 0 and null. Returns the items answered.
local function cancel_answer(cx, ids, recs)
  local now, code = now_ms(), cx.code
  local res = {model = cx.model, job = cx.job, error = {code = code, message = cx.message}, finished_at = now,
    deliveries = 0}
  local marks = {}
  for _, id in ipairs(ids) do
    local rec = recs[id] or {0, 'null'}
    res.id, res.input_tokens, res.payload = id, rec[1], rec[2]
    redis.call('XADD', cx.results_key, '*', 'id', id, 'r', result_record(res))
    marks[#marks + 1] = id
    marks[#marks + 1] = 'd'
  end
  for s = 1, #marks, 2000 do
    redis.call('HSET', cx.items_key, unpack(marks, s, math.min(s + 1999, #marks)))
  end
  if #ids > 0 then
    redis.call('HINCRBY', cx.job_key, 'failed', #ids)
    redis.call('HINCRBY', cx.job_key, code, #ids)  -- of them, answered by the end (conductor status's lines)
    redis.call('HINCRBY', cx.state_key, 'failed', #ids)
  end
  redis.call('HSET', cx.job_key, 'ending', code)
  job_end_stamp(cx.base, cx.job, cx.ends, #ids, now, code)
  return #ids
end
