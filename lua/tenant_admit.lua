#!lua
-- tenant_admit.lua: admit a Batch API batch against its tenant's enqueued-token limit (issue 35;
-- conductor/jobs/tenant_limits.py): the tokens of the tenant's batches not yet ended plus this one's,
-- at most the limit, and the batch counted among them, in one step (two creates at once cannot
-- both take the last room). The caller takes ended batches out first (their end is in each job's
-- meta, another slot); one it missed only makes this refusal stricter, never laxer.
--
-- KEYS[1] open     cdr:tenant:{T}:open    (batch -> input tokens)
-- KEYS[2] opened   cdr:tenant:{T}:opened  (batch -> admitted at, ms)
-- ARGV[1] batch    the batch id (a job name: name_ok)
-- ARGV[2] tokens   its input tokens (integer 0..1e15)
-- ARGV[3] limit    the tenant's max_enqueued_tokens (integer 0..1e15; 0: no limit, the batch is only counted)
-- ARGV[4] now      the admission time (ms)
-- Returns: {1, used} when admitted (used: the tenant's enqueued tokens with this batch; a batch
--   admitted before is admitted again, counted once), {0, used} when refused (used: without it;
--   nothing written). Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused).
-- Invariants: with a limit, the sum of KEYS[1]'s scores never goes past it through this script;
--   every check before the first write.
--@include lib.lua

local open, opened = KEYS[1], KEYS[2]
if #ARGV ~= 4 then return redis.error_reply('ERR_ARG argv: batch, tokens, limit, now') end
local batch, tokens, limit, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not name_ok(batch) then return redis.error_reply('ERR_ARG batch: must be a job name (keys.py check_name)') end
if not int_in(tokens, 0, 1e15) then return redis.error_reply('ERR_ARG tokens: must be an integer in 0..1e15') end
if not int_in(limit, 0, 1e15) then return redis.error_reply('ERR_ARG limit: must be an integer in 0..1e15') end
if not int_in(now, 0, 1e15) then return redis.error_reply('ERR_ARG now: must be an integer >= 0 (ms)') end

local refused = acl_refused(function(ok)
  return ok('ZRANGE', open) and ok('ZADD', open) and ok('ZADD', opened)
end)
if refused then return refused end

local used = 0
local rows = redis.call('ZRANGE', open, 0, -1, 'WITHSCORES')
for i = 1, #rows, 2 do
  if rows[i] ~= batch then used = used + tonumber(rows[i + 1]) end
end
if limit > 0 and used + tokens > limit then return {0, used} end
redis.call('ZADD', open, tokens, batch)
redis.call('ZADD', opened, now, batch)
return {1, used + tokens}
