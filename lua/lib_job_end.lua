-- lib_job_end.lua: the end stamp of a job's part on a model (one truth about a job,
-- conductor/jobs/job_state.py). The call that gives the part's last item its result sets
-- 'ended_ms' (the time of that result) and 'end' (how it ended: the job's 'ending', set by a cancel
-- or an expiry, else 'completed') in the job's counters; readers report it and none writes it.
-- Keys: M:job:J (HMGET, HSET: the workers' job counters), M:in:J (HMGET: the producer's).
-- Invariant: a part is stamped only when completed + failed reaches submitted with every item the
--   producer declared submitted (a submit still sending does not end the job); its counters are
--   read (job_end_read) before the caller's first write, and the stamp written after its counts.

-- The commands job_end_read and job_end_stamp may run, for acl_refused (lib.lua).
local function job_end_ok(ok, base, job)
  local jk = base .. ':job:' .. job
  return ok('HMGET', jk) and ok('HSET', jk) and ok('HMGET', base .. ':in:' .. job)
end

-- base: cdr:{model}. What job_end_stamp needs, read now.
local function job_end_read(base, job)
  local jc = redis.call('HMGET', base .. ':job:' .. job, 'completed', 'failed', 'ending')
  local ic = redis.call('HMGET', base .. ':in:' .. job, 'submitted', 'declared')
  return {answered = (tonumber(jc[1]) or 0) + (tonumber(jc[2]) or 0), ending = jc[3],
          submitted = tonumber(ic[1]) or 0, declared = tonumber(ic[2]) or 0}
end

-- e: job_end_read's table; added: results the caller wrote since; at_ms: the last one's time;
-- how: the end when the caller knows it (lib_cancel.lua), else the job's ending or 'completed'.
local function job_end_stamp(base, job, e, added, at_ms, how)
  if added > 0 and e.submitted > 0 and e.submitted >= e.declared and e.answered + added >= e.submitted then
    redis.call('HSET', base .. ':job:' .. job, 'ended_ms', at_ms, 'end', how or e.ending or 'completed')
  end
end
