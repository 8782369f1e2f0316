#!lua
-- The shebang (no flags) makes Redis 7 refuse this script at maxmemory before it runs (as
-- submit.lua is) and, on a cluster node, refuse any key outside the slot of the model's hash tag.
-- declare.lua: before sending a job's items, a producer records how many it is sending for this
-- model, so that a loss between the producer and the data (a failover to a replica that had not
-- received them, an interrupted submit) shows as items missing instead of a finished, smaller job.
--
-- KEYS[1] job    cdr:{model}:in:J    (field "declared" beside submitted: the producer's job hash)
-- KEYS[2] state  cdr:{model}:state
-- ARGV[1] count  the items (distinct ids) the producer is sending for this model, 1..10^12
-- Returns: the declared count now: the larger of the stored one and count. Errors, with nothing
--   written: 'ERR_ARG count: ...'; 'NOPERM ...' (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: "declared" only grows, and every id the producer sent counts once whether it was new
--   or there already, so after a complete submit the job's submitted >= declared; less means items
--   the producer sent are missing (`conductor status` reports them as lost). Written before the
--   items (and with wait_replicas confirmed by replicas first), so the declaration survives a
--   failover that loses the items after it.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua

local job_key, state_key = KEYS[1], KEYS[2]
local count = tonumber(ARGV[1])
if not int_in(count, 1, 1e12) then
  return redis.error_reply('ERR_ARG count: must be an integer in 1..10^12')
end
local refused = acl_refused(function(ok)
  return ok('HGET', job_key) and ok('HSET', job_key) and ok('HGET', state_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
local cur = tonumber(redis.call('HGET', job_key, 'declared')) or 0
if count <= cur then return cur end
redis.call('HSET', job_key, 'declared', count)
return count
