#!lua
-- The shebang (no flags) makes Redis 7 refuse this script at maxmemory before it runs (as
-- submit.lua is) and, on a cluster node, refuse any key outside the slot of the model's hash tag.
-- job_class.lua: a producer names, before its job's first item, whose work it is and how urgent
-- (issue 26): the tenant it is billed to, its priority class and its deadline. submit.lua reads
-- them for every call and places the job's items in shape instances of that tenant and class
-- only, so that a claim can choose between tenants, classes and deadlines.
--
-- KEYS[1] job    cdr:{model}:in:J    (the producer's job hash: fields tenant, prio, deadline_ms)
-- KEYS[2] state  cdr:{model}:state   (read only: paused)
-- ARGV[1] tenant    1..128 of [A-Za-z0-9._/@+=-]; '' for the job itself (a job without a tenant is its
--                   own tenant)
-- ARGV[2] priority  interactive | batch | background
-- ARGV[3] deadline  ms since the epoch, or 0 for none
-- Returns: {tenant, priority, deadline_ms} as stored. Errors, with nothing written: 'ERR_ARG
--   <field>: ...'; 'CONFLICT ...' when the job has items already under another class (its items
--   would be split between instances of two classes); 'NOPERM ...' (lib.lua acl_refused);
--   'PAUSED ...'.
-- Invariant: a job's class never changes once it has items; setting the same class again is a
--   no-op, so an interrupted submit that is run again passes.
--@include lib.lua

local job_key, state_key = KEYS[1], KEYS[2]
local tenant, prio, deadline = ARGV[1], ARGV[2], tonumber(ARGV[3])
local job = string.match(job_key, ':in:(.+)$')
if tenant == '' then tenant = job end
if not name_ok(tenant) then
  return redis.error_reply('ERR_ARG tenant: 1-' .. RULES.NAME_MAX .. ' characters from A-Z a-z 0-9 . _ / @ + = -')
end
if prio ~= 'interactive' and prio ~= 'batch' and prio ~= 'background' then
  return redis.error_reply('ERR_ARG priority: must be interactive, batch or background')
end
if not int_in(deadline, 0, 1e15) then
  return redis.error_reply('ERR_ARG deadline: must be a time in ms since the epoch, or 0')
end
local refused = acl_refused(function(ok)
  return ok('HMGET', job_key) and ok('HSET', job_key) and ok('HGET', state_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
local cur = redis.call('HMGET', job_key, 'tenant', 'prio', 'deadline_ms', 'submitted')
-- a job that never had a class is its own tenant, batch, without a deadline (submit.lua's defaults)
local same = (cur[1] or job) == tenant and (cur[2] or 'batch') == prio and tonumber(cur[3] or '0') == deadline
if not same and num(cur[4]) > 0 then
  return redis.error_reply('CONFLICT job ' .. job .. ' has items already as tenant ' .. tostring(cur[1] or job) ..
    ', priority ' .. tostring(cur[2] or 'batch') .. ': its class cannot change')
end
if not same then redis.call('HSET', job_key, 'tenant', tenant, 'prio', prio, 'deadline_ms', deadline) end
return {tenant, prio, deadline}
