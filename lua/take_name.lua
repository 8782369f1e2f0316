#!lua flags=allow-oom
-- allow-oom: a fresh worker must take its name on a Redis over maxmemory (as register.lua), or it
-- could not start to drain it. The shebang also makes a cluster node refuse any key outside the
-- slot of the model's hash tag.
-- take_name.lua: a worker started without a name of its own (no --name, no systemd instance)
-- takes the first free name of stem, stem-2, stem-3, ... so that any number of them run on one host.
--
-- KEYS[1] base   cdr:{model} (a name's heartbeat key is cdr:{model}:hb:<name>)
-- KEYS[2] (optional, not read) the stem's heartbeat key: with two keys declared, base never a key,
--   a Redis Cluster node refuses this call (ASK, then TRYAGAIN) while the slot is half moved to
--   another node, instead of running it where half the heartbeats are missing
-- ARGV[1] stem   the host name, 1..120 bytes of A-Z a-z 0-9 . _ / @ + = - (conductor/redis_contract/keys.py names)
-- ARGV[2] heartbeat value (ms since the epoch), ARGV[3] heartbeat TTL in ms (1..86400000)
-- ARGV[4] tries  how many names to try, 1..10000 (stem-10000 still fits a 128-byte name)
-- Returns: the name taken; nil when every name tried has a live heartbeat (nothing written).
--   Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...' when the caller's ACL refuses a
--   command this call may run (lib.lua acl_refused).
-- Invariant: a name is free while its heartbeat key is absent (a live worker renews it before it
--   expires); the name returned gets its heartbeat key in this same step, so two workers starting
--   at the same moment never take one name, and a live worker's name is never given out.
--@include lib.lua

local base = KEYS[1]
local stem, value, ttl, tries = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if #ARGV ~= 4 then return redis.error_reply('ERR_ARG argv: stem, value, ttl_ms and tries') end
if #stem < 1 or #stem > 120 or not string.find(stem, '^[%w%._/@%+=%-]+$') then
  return redis.error_reply('ERR_ARG stem: must be 1..120 characters from A-Z a-z 0-9 . _ / @ + = -')
end
if not int_in(value, 0, 1e15) or not int_in(ttl, 1, 86400000) then
  return redis.error_reply('ERR_ARG heartbeat: a time in ms and a TTL in 1..86400000 ms')
end
if not int_in(tries, 1, 10000) then return redis.error_reply('ERR_ARG tries: must be an integer in 1..10000') end

local refused = acl_refused(function(ok)
  return ok('EXISTS', base .. ':hb:' .. stem) and ok('SET', base .. ':hb:' .. stem)
end)
if refused then return refused end

for i = 1, tries do
  local name = stem
  if i > 1 then name = stem .. '-' .. i end
  local hb_key = base .. ':hb:' .. name
  if redis.call('EXISTS', hb_key) == 0 then
    redis.call('SET', hb_key, ARGV[2], 'PX', ttl)
    return name
  end
end
return false
