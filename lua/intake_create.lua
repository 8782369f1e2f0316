#!lua
-- intake_create.lua: record a job's intake task born leased to its creator
-- (conductor/intake/intake_task.py). The task and its lease are one write: a task recorded first
-- and leased by a second call was, in between, an open task with no live lease, which a resumer
-- (conductor/intake/intake_resume.py) took from the process still submitting it (issue 37).
--
-- KEYS[1] task    cdr:job:J:intake
-- ARGV[1] owner   the creating process (1..200 bytes)
-- ARGV[2] ms      the lease's time to live (1..600000 ms)
-- ARGV[3..] pairs field, value of the task (intake_task.Task.fields: job, source, path and state
--                 required, each field checked); owner, lease_ms and takes are this script's to write
-- Returns: {1} when recorded (a task of the job that had ended, or whose holder's lease ran out,
--   is replaced whole); {0, holder} when another owner's lease on an open task runs (nothing
--   written). Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused).
-- Invariants: a live holder's task is never replaced; the new task holds its creator's lease
--   from its first moment; every check before the first write.
--@include lib.lua

local task = KEYS[1]
if #ARGV < 4 or #ARGV % 2 ~= 0 then
  return redis.error_reply('ERR_ARG argv: owner, ms, then field value pairs')
end
local owner, ms = ARGV[1], tonumber(ARGV[2])
if #owner < 1 or #owner > 200 then return redis.error_reply('ERR_ARG owner: must be 1..200 bytes') end
if not int_in(ms, 1, 600000) then return redis.error_reply('ERR_ARG ms: must be an integer in 1..600000') end
-- The task's fields (intake_task.Task.fields), each with its check: junk is refused, never recorded.
-- digits, not a Lua number: mtime_ns (about 1.8e18) is past a double's exact integers
local function count(v) return #v <= 20 and v:match('^%d+$') ~= nil end
local function text(v) return #v >= 1 and #v <= 4096 end
local function json_list(v) return v:sub(1, 1) == '[' and v:sub(-1) == ']' end
local function json_object(v) return v:sub(1, 1) == '{' and v:sub(-1) == '}' end
local CHECK = {
  job = text, path = text, file_id = text, endpoint = text,
  source = function(v) return v == 'cli' or v == 'api' end,
  state = function(v) return v == 'checking' or v == 'sending' end,
  line = count, sent = count, created_ms = count, size = count, mtime_ns = count,
  skip_invalid = function(v) return v == '1' end,
  job_class = json_list, defaults = json_object,
}
local seen = {}
for i = 3, #ARGV, 2 do
  local name, value = ARGV[i], ARGV[i + 1]
  if not CHECK[name] then return redis.error_reply('ERR_ARG ' .. name .. ': not a field of an intake task') end
  if seen[name] then return redis.error_reply('ERR_ARG ' .. name .. ': given twice') end
  if not CHECK[name](value) then return redis.error_reply('ERR_ARG ' .. name .. ': not a valid value') end
  seen[name] = true
end
for _, name in ipairs({'job', 'source', 'path', 'state'}) do
  if not seen[name] then return redis.error_reply('ERR_ARG ' .. name .. ': required') end
end

local refused = acl_refused(function(ok)
  return ok('HMGET', task) and ok('DEL', task) and ok('HSET', task) and ok('TIME')
end)
if refused then return refused end

local f = redis.call('HMGET', task, 'state', 'owner', 'lease_ms')
local now = now_ms()
if (f[1] == 'checking' or f[1] == 'sending') and f[2] ~= owner and (tonumber(f[3]) or 0) > now then
  return {0, f[2]}
end
redis.call('DEL', task)
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
-- takes 1: the creator's taking, as intake_lease.lua counts a new holder (the resumer compares it)
redis.call('HSET', task, 'owner', owner, 'lease_ms', now + ms, 'takes', 1, unpack(fields))
return {1}
