#!lua flags=allow-oom
-- allow-oom: at maxmemory a full Redis must still drain (this script frees or moves memory); only
-- submit.lua is refused, with QueueFull.
-- reclaim.lua: move a dead consumer's pending batches to the reclaimed queue (served first).
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] cfg        cdr:{model}:cfg
-- KEYS[3] state      cdr:{model}:state
-- KEYS[4] batches    cdr:{model}:batches   (group "workers")
-- KEYS[5] reclaimed  cdr:{model}:reclaimed
-- ARGV[1] consumer     whose pending entries to take
-- ARGV[2] force        1: take them even with a live heartbeat (a draining worker handing back)
-- ARGV[3] min_idle_ms  with a live heartbeat, still take entries idle this long (lease lost);
--                      0 disables this fallback
-- ARGV[4] count        at most this many batches per call (the caller loops)
-- Returns: {batches, items requeued, items dead-lettered, pending left, consumer deleted 0|1}
--   A dead consumer's newest batch is blamed for its death (dead-lettered at max_deliveries),
--   the others, and every batch of a live or draining one, only at twice that (lib_requeue.lua).
--   Errors, with nothing written: 'ERR_ARG <field>: ...'; 'NOPERM ...' when the caller's ACL
--   refuses a command this call may run (lib.lua acl_refused); 'ERR_STATE ...' when a batch's
--   item record does not decode (every batch is read before the first write); 'PAUSED ...'.
-- Invariants: a consumer whose heartbeat key lives keeps its leased batches (the heartbeat
--   thread extends leases with XCLAIM JUSTID); results already written are never redone;
--   the consumer is deleted only once its pending list is empty (DELCONSUMER would discard it).
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua
--@include lib_requeue_prologue.lua

local base, state_key, batches_key = KEYS[1], KEYS[3], KEYS[4]
local consumer, force = ARGV[1], ARGV[2]
local min_idle, count = tonumber(ARGV[3]), tonumber(ARGV[4])
local bad = consumer_bad(consumer)
if bad then return bad end
if force ~= '0' and force ~= '1' then return redis.error_reply('ERR_ARG force: must be 0 or 1') end
if not int_in(min_idle, 0, 1e15) then
  return redis.error_reply('ERR_ARG min_idle_ms: must be an integer in 0..1e15')
end
if not int_in(count, 1, 1000) then
  return redis.error_reply('ERR_ARG count: must be an integer in 1..1000')
end

local rq, refused = requeue_prologue(KEYS, function(ok)
  return ok('EXISTS', base .. ':hb:' .. consumer) and ok('HDEL', base .. ':workers')
    and ok('XGROUP', 'DELCONSUMER', batches_key, GROUP, consumer)
end)
if not rq then return refused end
local alive = redis.call('EXISTS', base .. ':hb:' .. consumer) == 1
local idle_floor = 0
if alive and force ~= '1' then
  if min_idle == 0 then return {0, 0, 0, -1, 0} end
  idle_floor = min_idle
end

-- A consumer that died holding several batches most likely died admitting the last one it
-- took: only that one is blamed (lib_requeue.lua). A worker holds few batches, so this
-- scan stays small.
local newest = nil
if not alive then
  local all = redis.call('XPENDING', batches_key, GROUP, '-', '+', 100000, consumer)
  if #all > 0 then newest = all[#all][1] end
end
local pending = redis.call('XPENDING', batches_key, GROUP, 'IDLE', idle_floor, '-', '+', count, consumer)
-- Every batch read and decided before the first write.
local plans = {}
for _, p in ipairs(pending) do
  local plan, err = requeue_plan(rq, p[1], 'consumer ' .. consumer .. (alive and ' lost its lease' or ' died'),
    p[1] == newest)
  if not plan then return err end
  plans[#plans + 1] = plan
end
local batches, items, dead = 0, 0, 0
for _, plan in ipairs(plans) do
  local k, d = requeue_apply(rq, plan)
  batches = batches + 1
  items = items + k
  dead = dead + d
end
local left = #redis.call('XPENDING', batches_key, GROUP, '-', '+', 1, consumer)
local deleted = 0
if left == 0 and not alive then
  redis.call('XGROUP', 'DELCONSUMER', batches_key, GROUP, consumer)
  redis.call('HDEL', base .. ':workers', consumer)
  deleted = 1
end
if batches > 0 then redis.call('HINCRBY', state_key, 'reclaims', batches) end
return {batches, items, dead, left, deleted}
