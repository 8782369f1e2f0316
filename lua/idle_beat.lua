#!lua flags=allow-oom
-- allow-oom: an idle worker's heartbeat must go on over maxmemory, as heartbeat.lua's (a refused
-- one would let the worker count as dead). The shebang also makes a cluster node refuse any key
-- outside the slot of the model's hash tag.
-- idle_beat.lua: an idle worker's one call per beat (workers/idle.py), in place of the heartbeat,
-- the maintenance lease's take or renewal and the timed claim that found nothing: 1,000 idle
-- workers must cost Redis under 5 % of a core (issue 36), and each of those was a round trip.
--
-- KEYS[1] heartbeat  cdr:{model}:hb:<worker>
-- KEYS[2] busy       cdr:{model}:busy         (hash: worker -> busy ms)
-- KEYS[3] lease      cdr:{model}:lease:maint
-- KEYS[4] state      cdr:{model}:state        (reclaimed_items, paused)
-- KEYS[5] intake     cdr:{model}:intake       (tokens, stored_tokens: what waits in lanes and store segments)
-- KEYS[6] hot        cdr:{model}:hot          (interactive work waiting)
-- KEYS[7] workers    cdr:{model}:workers      (the registrations)
-- KEYS[8] batches    cdr:{model}:batches      (optional: the stream whose group's pending count the
--                    lease holder is told, so that its sweep need not read it while nothing is in flight)
-- KEYS[9] holding    cdr:{model}:holding      (optional, with KEYS[8]; a sharded model's own keys: a worker
--                    that holds batches on a shard, or is about to claim, set it for its TTL: lua/heartbeat.lua)
-- KEYS[10] beats     cdr:{model}:beats        (optional, with KEYS[9]; a sharded model's own keys: worker ->
--                    when the heartbeat this call sets runs out, ms on Redis's clock. An idle worker's shard
--                    heartbeats live a round of the shards, so the holder, told who lapsed here, deletes
--                    theirs: a worker killed while idle leaves each shard's fleet size about a TTL after)
-- ARGV[1] worker     1..200 bytes, the caller's consumer name (and the lease's owner)
-- ARGV[2] value      ms since the epoch; ARGV[3] ttl_ms (1..86400000): the heartbeat
-- ARGV[4] lease_ms   the maintenance lease's time to live (1..86400000)
-- ARGV[5] busy_ms    the worker's busy time (0..1e15), or '' when unchanged since it was last written
-- Returns: {held, waits, registered, in_flight, holding, lapsed}: held 1 when the caller holds the maintenance
--   lease now (taken or renewed), waits 1 when a claim could find work (reclaimed batches, waiting tokens in lanes
--   or store segments, interactive work) on a model that is not paused, registered 0 when the caller's registration
--   is gone (a FLUSHALL, a new server: the worker joins again, as a claim's NOGROUP would have told it before it
--   stopped claiming while idle); in_flight the batches pending in the group when KEYS[8] is given and the caller
--   holds the lease, else -1 (read only for the holder: XPENDING's summary walks the group's consumers); holding 1
--   when KEYS[9] exists (read for the holder too, else 0); lapsed, with KEYS[10] and for the holder, at most 16
--   workers whose entry in beats has run out and whose heartbeat key is gone (dead: each entry run out is dropped, a
--   live worker's put back by its next beat), else empty. Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...'
--   (lib.lua acl_refused).
-- Invariants: the heartbeat is renewed as heartbeat.lua renews it (an idle worker leases no
--   batch); the lease as lease.lua takes it: one holder at a time, renewed only by its holder;
--   waits is 0 only when claim.lua would answer 'idle' or 'paused', so a worker that skips its
--   claim on 0 misses no work (a ring wakes it for new work before the next beat).
--@include lib.lua

local hb_key, busy_key, lease_key, state_key, intake_key, hot_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local workers_key, batches_key, holding_key, beats_key = KEYS[7], KEYS[8], KEYS[9], KEYS[10]
if #ARGV ~= 5 then return redis.error_reply('ERR_ARG argv: worker, value, ttl_ms, lease_ms and busy_ms') end
local worker, value, ttl, lease_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if #worker < 1 or #worker > 200 then return redis.error_reply('ERR_ARG worker: must be 1..200 bytes') end
if not int_in(value, 0, 1e15) or not int_in(ttl, 1, 86400000) then
  return redis.error_reply('ERR_ARG heartbeat: a time in ms and a TTL in 1..86400000 ms')
end
if not int_in(lease_ms, 1, 86400000) then
  return redis.error_reply('ERR_ARG lease_ms: must be an integer in 1..86400000')
end
if ARGV[5] ~= '' and not int_in(tonumber(ARGV[5]), 0, 1e15) then
  return redis.error_reply('ERR_ARG busy_ms: an integer in 0..1e15, or empty')
end
local refused = acl_refused(function(ok)
  return ok('SET', hb_key) and ok('HSET', busy_key) and ok('GET', lease_key) and ok('PEXPIRE', lease_key)
    and ok('SET', lease_key) and ok('HMGET', state_key) and ok('HMGET', intake_key) and ok('EXISTS', hot_key)
    and ok('HEXISTS', workers_key) and (not batches_key or (ok('EXISTS', batches_key) and ok('XPENDING', batches_key)))
    and (not holding_key or ok('EXISTS', holding_key))
    and (not beats_key or (ok('ZADD', beats_key) and ok('ZRANGE', beats_key) and ok('ZREM', beats_key)
      and ok('EXISTS', hb_key) and ok('TIME')))
end)
if refused then return refused end

local holder = redis.call('GET', lease_key)
local registered = redis.call('HEXISTS', workers_key, worker)
local st = redis.call('HMGET', state_key, 'reclaimed_items', 'paused')
local waiting = redis.call('HMGET', intake_key, 'tokens', 'stored_tokens')
-- the lease is the caller's after this call exactly when it is its own or free now (no write between)
local in_flight, holding, ran_out, lapsed = -1, 0, {}, {}
local now = beats_key and now_ms()
if batches_key and (holder == worker or not holder) then
  in_flight = 0
  if redis.call('EXISTS', batches_key) == 1 then in_flight = redis.call('XPENDING', batches_key, GROUP)[1] end
  if holding_key then holding = redis.call('EXISTS', holding_key) end
  if beats_key then
    ran_out = redis.call('ZRANGE', beats_key, '-inf', now, 'BYSCORE', 'LIMIT', 0, 16)
    -- the worker's heartbeat key is the judge (its TTL is Redis's own); the entry only says when to look
    local base = string.sub(beats_key, 1, #beats_key - #':beats')
    for _, w in ipairs(ran_out) do
      if w ~= worker and redis.call('EXISTS', base .. ':hb:' .. w) == 0 then lapsed[#lapsed + 1] = w end
    end
  end
end
local waits = 0
if st[2] ~= '1' and (num(st[1]) > 0 or num(waiting[1]) > 0 or num(waiting[2]) > 0
    or redis.call('EXISTS', hot_key) == 1) then
  waits = 1
end

redis.call('SET', hb_key, ARGV[2], 'PX', ttl)
if #ran_out > 0 then redis.call('ZREM', beats_key, unpack(ran_out)) end
if beats_key then redis.call('ZADD', beats_key, now + ttl, worker) end
if ARGV[5] ~= '' then redis.call('HSET', busy_key, worker, ARGV[5]) end
local held = 0
if holder == worker then
  held = redis.call('PEXPIRE', lease_key, lease_ms)
elseif not holder then
  held = redis.call('SET', lease_key, worker, 'NX', 'PX', lease_ms) and 1 or 0
end
return {held, waits, registered, in_flight, holding, lapsed}
