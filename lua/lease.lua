#!lua flags=allow-oom
-- allow-oom: the sweep (reclaim, trim) is how a Redis over maxmemory gets memory back. The shebang
-- also makes a cluster node refuse any key outside the slot of the model's hash tag.
-- lease.lua: take or renew the maintenance lease (workers/maintenance.py): renew-if-mine in one
-- step, so a lease that expired and went to another worker is not taken back.
--
-- KEYS[1] lease   cdr:{model}:maint_lease
-- ARGV[1] owner   the worker asking (1..200 bytes, as register.lua takes its name)
-- ARGV[2] ms      the lease's time to live (1..86400000 ms); 0 hands the caller's lease back (deleted,
--                 free at once: the schema's migration lease when its migrations are done)
-- Returns: 1 when the caller holds the lease now, 0 when another worker does (or, with ms 0, when
--   the lease is free now). Errors, with
--   nothing written: 'ERR_ARG ...'; 'NOPERM ...' when the caller's ACL refuses a command this
--   call may run (lib.lua acl_refused).
-- Invariants: one holder at a time; only the holder extends it (GET then PEXPIRE in one step).
--@include lib.lua

local lease_key = KEYS[1]
local owner, ms = ARGV[1], tonumber(ARGV[2])
if #ARGV ~= 2 then return redis.error_reply('ERR_ARG argv: owner and ms') end
if #owner < 1 or #owner > 200 then return redis.error_reply('ERR_ARG owner: must be 1..200 bytes') end
if not int_in(ms, 0, 86400000) then return redis.error_reply('ERR_ARG ms: must be an integer in 0..86400000') end

local refused = acl_refused(function(ok)
  return ok('GET', lease_key) and ok('PEXPIRE', lease_key) and ok('SET', lease_key) and ok('DEL', lease_key)
end)
if refused then return refused end

local holder = redis.call('GET', lease_key)
if ms == 0 then
  if holder == owner then redis.call('DEL', lease_key) end
  return 0
end
if holder == owner then
  return redis.call('PEXPIRE', lease_key, ms)
end
return redis.call('SET', lease_key, owner, 'NX', 'PX', ms) and 1 or 0
