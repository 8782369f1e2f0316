#!lua
-- batch_finalize.lua: a Batch API batch's last moves (conductor/api/finalize.py): 'start' moves a
-- batch whose every line is answered to finalizing while its output and error files are written;
-- 'done' moves it to completed once they are in place. A cancel or an expiry recorded meanwhile
-- (job_state.end writes 'ending') wins: the batch then ends cancelled or expired, never completed.
--
-- KEYS[1] meta    cdr:job:J:meta (the job's lifecycle hash)
-- ARGV[1] step    'start' or 'done'
-- ARGV[2] at      the stamp to keep (seconds): start: finalizing_at (the time of the last answer,
--                 so that every reader shows the same one); done: completed_at
-- ARGV[3..] pairs field, value written with 'done': output_lines, error_lines (integers >= 0)
-- Returns: 1 when the batch is (now) finalizing ('start') or completed ('done'); 0 when it is not
--   the step's to move: a batch that is not one (no 'finalize' mark), one that ended or is ending
--   (cancelled, expired, failed, an 'ending' recorded), or for 'done' one not finalizing (nothing
--   written). Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused).
-- Invariants: completed only from finalizing and only without an 'ending'; stamps are set once
--   (HSETNX); every check before the first write.
--@include lib.lua

local meta = KEYS[1]
if #ARGV < 2 or #ARGV % 2 ~= 0 then
  return redis.error_reply('ERR_ARG argv: step, at, then field value pairs')
end
local step, at = ARGV[1], tonumber(ARGV[2])
if step ~= 'start' and step ~= 'done' then return redis.error_reply('ERR_ARG step: must be start or done') end
if not int_in(at, 0, 1e12) then return redis.error_reply('ERR_ARG at: must be an integer >= 0 (seconds)') end
local FIELDS = {output_lines = true, error_lines = true}
for i = 3, #ARGV, 2 do
  if step ~= 'done' or not FIELDS[ARGV[i]] then
    return redis.error_reply('ERR_ARG ' .. ARGV[i] .. ': not a field this step writes')
  end
  if not int_in(tonumber(ARGV[i + 1]), 0, 1e15) then
    return redis.error_reply('ERR_ARG ' .. ARGV[i] .. ': must be an integer >= 0')
  end
end

local refused = acl_refused(function(ok)
  return ok('HMGET', meta) and ok('HSET', meta) and ok('HSETNX', meta)
end)
if refused then return refused end

local f = redis.call('HMGET', meta, 'status', 'ending', 'finalize')
local status, ending = f[1], f[2]
if f[3] ~= '1' or (ending and ending ~= '') then return 0 end
if step == 'start' then
  if status ~= 'validating' and status ~= 'in_progress' and status ~= 'finalizing' then return 0 end
  redis.call('HSET', meta, 'status', 'finalizing')
  redis.call('HSETNX', meta, 'finalizing_at', at)
  return 1
end
if status ~= 'finalizing' then return 0 end
local fields = {'status', 'completed'}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', meta, unpack(fields))
redis.call('HSETNX', meta, 'completed_at', at)
return 1
