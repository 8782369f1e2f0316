#!lua
-- intake_lease.lua: take, renew or hand back the lease on a job's intake task
-- (conductor/intake/intake_task.py): the one process that reads the job's input file and sends
-- its items now. A process that died (serve killed mid-intake) stops renewing; once its lease has
-- run out a resumer (another serve, a restarted one, a maintenance lease holder) takes the task
-- and goes on from its cursor.
--
-- KEYS[1] task    cdr:job:J:intake
-- ARGV[1] owner   the process asking (1..200 bytes)
-- ARGV[2] ms      the lease's time to live (1..600000 ms); 0 hands the caller's lease back
--                 (a graceful stop: the task is free to take at once)
-- Returns: {1, line, sent, state} when the caller holds the lease now (line: the last input line
--   whose chunk Redis acknowledged, 0 before the first; sent: items sent; state: checking or
--   sending); {0, why} otherwise, why 'held' (another owner's lease runs), 'ended' (done, stopped,
--   failed) or 'missing' (no such task). Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...'
--   when the caller's ACL refuses a command this call may run (lib.lua acl_refused).
-- Invariants: one holder at a time (the owner is compared and set in one step, against the
--   server's clock); an ended task is never taken again; every check before the first write.
--@include lib.lua

local task = KEYS[1]
if #ARGV ~= 2 then return redis.error_reply('ERR_ARG argv: owner and ms') end
local owner, ms = ARGV[1], tonumber(ARGV[2])
if #owner < 1 or #owner > 200 then return redis.error_reply('ERR_ARG owner: must be 1..200 bytes') end
if not int_in(ms, 0, 600000) then return redis.error_reply('ERR_ARG ms: must be an integer in 0..600000') end

local refused = acl_refused(function(ok)
  return ok('HMGET', task) and ok('HSET', task) and ok('HINCRBY', task) and ok('TIME')
end)
if refused then return refused end

local f = redis.call('HMGET', task, 'state', 'owner', 'lease_ms', 'line', 'sent')
local state, holder, until_ms = f[1], f[2], tonumber(f[3]) or 0
if not state then return {0, 'missing'} end
if state ~= 'checking' and state ~= 'sending' then return {0, 'ended'} end
local now = now_ms()
if holder ~= owner and until_ms > now then return {0, 'held'} end
if ms == 0 then
  if holder == owner then redis.call('HSET', task, 'lease_ms', 0) end
  return {0, 'released'}
end
redis.call('HSET', task, 'owner', owner, 'lease_ms', now + ms)
if holder ~= owner then redis.call('HINCRBY', task, 'takes', 1) end
return {1, tonumber(f[4]) or 0, tonumber(f[5]) or 0, state}
