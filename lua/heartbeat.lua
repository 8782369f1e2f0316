#!lua flags=allow-oom
-- allow-oom: a live worker's heartbeat must go on while Redis is over maxmemory (noeviction, the
-- workers drain it): a refused heartbeat would let its batches be reclaimed and run twice. The
-- shebang also makes a cluster node refuse any key outside the slot of the model's hash tag.
-- heartbeat.lua: renew a worker's heartbeat, extend the lease on its in-flight batches and publish
-- its busy time (read by the exporter's fleet balance gauge, conductor/observability/broker_metrics.py).
--
-- KEYS[1] heartbeat  cdr:{model}:hb:<worker>
-- KEYS[2] batches    cdr:{model}:batches   (group "workers")
-- KEYS[3] busy       cdr:{model}:busy      (hash: worker -> busy ms)
-- KEYS[4] holding    cdr:{model}:holding   (optional, a sharded model's own keys: set for the TTL, so
--                    that the model's idle lease holder, whose beat reads it, sweeps its quiet shards)
-- ARGV[1] worker     the consumer whose batches these are
-- ARGV[2] value      ms since the epoch; ARGV[3] ttl_ms (1..86400000)
-- ARGV[4] busy_ms    the worker's time with sequences in its engine since it started (0..1e15)
-- ARGV[5..]          ids of the worker's in-flight batches (at most 10000)
-- Returns: the number of those batches still pending for it (their idle time reset). Errors, with
--   nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused); NOGROUP.
-- Invariant: XCLAIM with JUSTID resets the idle time of the worker's own pending entries without
--   counting a delivery (a lease extension), and takes nothing of another consumer's: an id that
--   is pending for someone else is skipped (reclaimed meanwhile and handed on).
--@include lib.lua

local hb_key, batches_key, busy_key, holding_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local worker, value, ttl, busy = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not worker or #worker < 1 or #worker > 200 then
  return redis.error_reply('ERR_ARG worker: must be 1..200 bytes')
end
if not int_in(value, 0, 1e15) or not int_in(ttl, 1, 86400000) then
  return redis.error_reply('ERR_ARG heartbeat: a time in ms and a TTL in 1..86400000 ms')
end
if not int_in(busy, 0, 1e15) then return redis.error_reply('ERR_ARG busy_ms: an integer in 0..1e15') end
if #ARGV - 4 > 10000 then return redis.error_reply('ERR_ARG ids: at most 10000') end
for i = 5, #ARGV do
  if not stream_id_ok(ARGV[i]) then return redis.error_reply('ERR_ARG ids: ' .. string.sub(ARGV[i], 1, 40)) end
end
local refused = acl_refused(function(ok)
  return ok('SET', hb_key) and ok('XPENDING', batches_key) and ok('XCLAIM', batches_key) and ok('HSET', busy_key)
    and (not holding_key or ok('SET', holding_key))
end)
if refused then return refused end
-- The worker's own pending entries among the ids (read first: NOGROUP refuses here).
local mine = {}
for i = 5, #ARGV do
  local p = redis.call('XPENDING', batches_key, GROUP, ARGV[i], ARGV[i], 1)[1]
  if p and p[2] == worker then mine[#mine + 1] = ARGV[i] end
end
redis.call('SET', hb_key, ARGV[2], 'PX', ttl)
redis.call('HSET', busy_key, worker, ARGV[4])
if holding_key then redis.call('SET', holding_key, worker, 'PX', ttl) end
for s = 1, #mine, 1000 do
  local args = {batches_key, GROUP, worker, 0}
  for i = s, math.min(s + 999, #mine) do args[#args + 1] = mine[i] end
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return #mine
