-- lib_workers.lua: which live workers serve which shape instance, as claim.lua reads it: a worker
-- lives while its heartbeat key does; M:affinity names the active instance each one serves.
-- Keys: M:hb:W (EXISTS), M:affinity (HGETALL, HSET, HDEL), M:workers (HKEYS).
-- Invariant: a dead worker's affinity entry is dropped when read, so no instance counts a worker
--   that will not come back for it; reads are bounded by the fleet, never by the queue.
--@include lib.lua

-- A worker lives while its heartbeat key does (it expires with the worker's TTL). Asked once per
-- worker a call (c.live): a claim that changes shape asks of the whole fleet in attachments() and
-- again in fleet_size(), and a key does not expire while a script runs, so the answer holds.
local function alive(c, worker)
  local live = c.live
  if not live then
    live = {}
    c.live = live
  end
  local v = live[worker]
  if v == nil then
    v = redis.call('EXISTS', c.base .. ':hb:' .. worker) == 1
    live[worker] = v
  end
  return v
end

-- Workers serving each active instance, the claiming one apart; a dead worker's entry (its
-- heartbeat key gone) is dropped. Bounded by the fleet; read only when a worker changes shape.
local function attachments(c)
  local aff = redis.call('HGETALL', c.affinity_key)
  local n = {}
  for i = 1, #aff, 2 do
    if aff[i] ~= c.consumer then
      if alive(c, aff[i]) then
        n[aff[i + 1]] = (n[aff[i + 1]] or 0) + 1
      else
        redis.call('HDEL', c.affinity_key, aff[i])
      end
    end
  end
  return n
end

local function attach(c, inst)
  redis.call('HSET', c.affinity_key, c.consumer, inst)
  return inst
end

-- Live workers of the model (registered, heartbeat key present), this one included: the fleet a
-- fair share is counted over. Bounded by the fleet; read only when a worker changes shape.
local function fleet_size(c)
  local n = 1
  for _, w in ipairs(redis.call('HKEYS', c.base .. ':workers')) do
    if w ~= c.consumer and alive(c, w) then n = n + 1 end
  end
  return n
end
