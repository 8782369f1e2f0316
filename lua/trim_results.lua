#!lua flags=allow-oom
-- allow-oom: trimming is how a full Redis gets memory back. The shebang also makes a cluster node
-- refuse any key outside the slot of the model's hash tag.
-- trim_results.lua: drop a finished job's results older than a cut-off (retention).
--
-- KEYS[1] intake   cdr:{model}:in:J           (submitted)
-- KEYS[2] job      cdr:{model}:job:J          (completed, failed)
-- KEYS[3] results  cdr:{model}:job:J:results
-- ARGV[1] before_ms  results written before this time (ms since the epoch) go
-- Returns: the number of result entries trimmed. Errors: 'ERR_ARG before_ms: ...';
--   'BUSY job has N items without a result' while the job is not finished, with nothing trimmed;
--   'NOPERM ...' when the caller's ACL refuses a command this call may run (lib.lua acl_refused).
-- Invariants: a job that still has items in flight keeps every result (a reader following it
--   has not seen them all); ids of the results stream are their write times, so MINID is the
--   cut-off, and the job's id registry (M:in:J:sums) still knows a trimmed item (no re-run on resubmit).
--@include lib.lua

local in_key, job_key, results_key = KEYS[1], KEYS[2], KEYS[3]
local before = tonumber(ARGV[1])
if not before or before < 0 or before ~= math.floor(before) or before > 253402300799999 then
  return redis.error_reply('ERR_ARG before_ms: must be an integer time in ms since the epoch')
end
local refused = acl_refused(function(ok)
  return ok('HGET', in_key) and ok('HMGET', job_key) and ok('XTRIM', results_key)
end)
if refused then return refused end
local c = redis.call('HMGET', job_key, 'completed', 'failed')
local left = (tonumber(redis.call('HGET', in_key, 'submitted')) or 0) - (tonumber(c[1]) or 0) - (tonumber(c[2]) or 0)
if left > 0 then
  return redis.error_reply('BUSY job has ' .. left .. ' items without a result')
end
return redis.call('XTRIM', results_key, 'MINID', string.format('%d', before))
