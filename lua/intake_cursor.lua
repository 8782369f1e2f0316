#!lua
-- intake_cursor.lua: the intake task's holder records its progress (conductor/intake/intake_task.py):
-- after Redis acknowledged a chunk of the job's items, the cursor moves past it (one call per
-- chunk); the same call renews the lease, and moves the task's state (sending once the file is
-- checked and declared; done, stopped or failed at its end).
--
-- KEYS[1] task    cdr:job:J:intake
-- ARGV[1] owner   the lease holder (intake_lease.lua)
-- ARGV[2] ms      the lease's new time to live (1..600000 ms; an ended task keeps none)
-- ARGV[3] line    the last input line sent (an integer >= 0; the cursor never moves back)
-- ARGV[4] sent    items sent so far (an integer >= 0; never moves back)
-- ARGV[5] state   '' keeps it, or sending, done, stopped, failed
-- ARGV[6..] pairs field, value written with it: reason, error, defaults, size, mtime_ns
-- Returns: 1 when written; 0 when the caller no longer holds the lease or the task has ended
--   (nothing written: a process whose lease lapsed stops, the new holder goes on). Errors, with
--   nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused).
-- Invariants: only the holder moves the cursor, forward only; an ended task is not written again;
--   every check before the first write.
--@include lib.lua

local task = KEYS[1]
if #ARGV < 5 or #ARGV % 2 ~= 1 then
  return redis.error_reply('ERR_ARG argv: owner, ms, line, sent, state, then field value pairs')
end
local owner, ms, line, sent, state = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
if not int_in(ms, 1, 600000) then return redis.error_reply('ERR_ARG ms: must be an integer in 1..600000') end
if not int_in(line, 0, 1e15) then return redis.error_reply('ERR_ARG line: must be an integer >= 0') end
if not int_in(sent, 0, 1e15) then return redis.error_reply('ERR_ARG sent: must be an integer >= 0') end
local ENDED = {done = true, stopped = true, failed = true}
if state ~= '' and state ~= 'sending' and not ENDED[state] then
  return redis.error_reply('ERR_ARG state: must be one of sending, done, stopped, failed')
end
local FIELDS = {reason = true, error = true, defaults = true, size = true, mtime_ns = true}
for i = 6, #ARGV, 2 do
  if not FIELDS[ARGV[i]] then
    return redis.error_reply('ERR_ARG ' .. ARGV[i] .. ': not a field this call writes')
  end
end

local refused = acl_refused(function(ok)
  return ok('HMGET', task) and ok('HSET', task) and ok('TIME')
end)
if refused then return refused end

local f = redis.call('HMGET', task, 'state', 'owner', 'line', 'sent')
if f[2] ~= owner or (f[1] ~= 'checking' and f[1] ~= 'sending') then return 0 end
local now = now_ms()
local fields = {'line', math.max(line, tonumber(f[3]) or 0), 'sent', math.max(sent, tonumber(f[4]) or 0),
                'lease_ms', now + ms}
if state ~= '' then
  fields[#fields + 1] = 'state'
  fields[#fields + 1] = state
  if ENDED[state] then
    fields[6] = 0
    fields[#fields + 1] = 'ended_ms'
    fields[#fields + 1] = now
  end
end
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', task, unpack(fields))
return 1
