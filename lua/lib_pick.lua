-- lib_pick.lua: the instance a worker serves next and the one it warms next (seeds 001, 003,
-- issues 24 and 26), from what lib_survey.lua finds waiting. Every function takes c, the claim
-- context claim.lua builds (the mutable warming_now and cleanup among its fields).
-- Keys: M:staged_age (ZRANGE), M:inst:S:E (HGET, HSET), M:warming, M:state (warming, warmings,
--   cleanup fields: lib_cleanup.lua); through lib_lifecycle.lua, lib_survey.lua and lib_fair.lua what
--   they touch.
-- Invariants: a worker serves one instance (its affinity) until it is empty or an aged shape
--   preempts it; each worker warms at most one instance, its next.
--@include lib.lua
--@include lib_cleanup.lua
--@include lib_fair.lua
--@include lib_workers.lua
--@include lib_lifecycle.lua
--@include lib_survey.lua

-- The staged instance whose oldest item has waited aging_ms, or nil.
local function aged(c)
  if c.cfg.aging_ms <= 0 then return nil end
  local old = redis.call('ZRANGE', c.base .. ':staged_age', '0', '0', 'WITHSCORES')
  if old[1] and c.now - tonumber(old[2]) >= c.cfg.aging_ms then return old[1] end
  return nil
end

-- The next shape for this worker (seeds 001, 003, the fleet of issue 24 and the fair share of
-- issue 26): an aged one first (no shape waits for ever behind popular ones). Else the tenants with
-- work waiting are taken in order, background work last: the one furthest below its share of the
-- fleet (its weight over the waiting tenants' weights) first, then the one with the smallest virtual
-- counter (lib_fair.lua); `only` keeps to one tenant (a fair switch, claim.lua). Within a tenant, as
-- longest-processing-time first does offline, the largest piece of its work: an instance left by
-- its workers; then an active instance whose workers hold more than the tenant's fair share each
-- (its remaining work over the workers it deserves) is joined, the most loaded first, while the
-- share this worker would take of it is no smaller than the staged candidate, so a deep shape
-- ends up split over as many workers as its work deserves; otherwise its staged instance that goes
-- first (before()) and holds a full batch (activate_batches 0, quiet intake, or cleanup: anything)
-- starts; with none, its active instance with the most work per worker is joined while it holds a
-- batch beyond one per worker: no worker idles while another's shape holds work it could take, and
-- none joins a shape that is about to be finished, unless its workers took nothing from it for
-- hygiene_idle_ms.
local function pick_next(c, cleanup, only)
  local cfg, now = c.cfg, c.now
  local old = aged(c)
  if old then
    -- An aged shape is served whatever its fill: it drains at once (late arrivals stage anew).
    activate(c, old, 'aging')
    redis.call('HSET', inst_key(c.base, old), 'state', 'draining', 'draining_ms', now)
    inst_written(c, old)
    return old
  end
  local budget = cfg.budget_tokens
  local ten, stuck = survey(c, activation_need(c, cleanup))
  local keys, names, fg = {}, {}, {}
  for key, x in pairs(ten) do
    if not only or x.name == only then
      keys[#keys + 1] = key
      if not x.bg then fg[key] = x end
      names[#names + 1] = x.name
    end
  end
  -- the fleet is counted only when there is a share to weigh: an idle worker's claim stays cheap
  local fleet, def, vtc = nil, {}, {}
  local function fleet_n()
    fleet = fleet or fleet_size(c)
    return fleet
  end
  if #keys > 1 then
    local pool = next(fg) and fg or ten
    def = deficits(c, pool, fleet_n())
    vtc = counters(c, names)
    table.sort(keys, function(a, b)
      local xa, xb = ten[a], ten[b]
      if xa.bg ~= xb.bg then return xb.bg end
      local da, db = def[a] or -math.huge, def[b] or -math.huge
      if da ~= db then return da > db end
      if vtc[xa.name] ~= vtc[xb.name] then return vtc[xa.name] < vtc[xb.name] end
      return a < b
    end)
  end
  for _, key in ipairs(keys) do
    local x = ten[key]
    if x.orphan then return attach(c, x.orphan) end  -- left by its workers: nothing else serves it
    local cand = x.cand
    if x.over and (not cand or x.over_work / (x.over_k + 1) >= cand[3]) then
      local deserved = def[key] and math.max(1, x.workers + def[key]) or fleet_n()
      if x.load > x.work / deserved then return attach(c, x.over) end
    end
    if cand then
      local inst, ctok = cand[1], cand[2]
      local why = 'cleanup'
      if cand[6] then why = 'warmed'
      elseif ctok >= cfg.activate_batches * budget then why = 'threshold'
      elseif ctok >= budget then why = 'depth' end
      if why == 'cleanup' and not c.cleanup then
        -- below every threshold, started because intake is quiet: the workload's tail (seed 001)
        c.cleanup = true
        enter_cleanup(c.state_key, c.now)
      end
      return activate(c, inst, why)
    end
    if x.help then return attach(c, x.help) end
  end
  -- Rather than idle while another worker's instance holds items it has not served for a while,
  -- help it: nothing waits on one worker alone.
  if stuck then return attach(c, stuck) end
  return nil
end

-- Pre-warm (seed 003): when the active instance runs low, mark the staged instance with the
-- most tokens (at least one full batch) as warming (one at a time) and tell the workers,
-- so graphs and caches are ready before the switch.
local function maybe_warm(c, inst_tokens, tenant)
  local cfg = c.cfg
  if inst_tokens >= cfg.prewarm_batches * cfg.budget_tokens then return end
  local cur = c.warming_now
  if cur ~= '' and redis.call('HGET', inst_key(c.base, cur), 'state') == 'warming' then return end
  -- The shape pick_next would start: one holding a full batch (in cleanup any, however small).
  local top = top_staged(c, activation_need(c, c.cleanup), tenant)
  if not top then return end
  redis.call('HSET', inst_key(c.base, top), 'state', 'warming', 'warming_ms', c.now, 'warming_for', c.consumer)
  inst_written(c, top)
  redis.call('HSET', c.warming_key, c.consumer, top)
  redis.call('HSET', c.state_key, 'warming', top)  -- the latest, for inspect
  c.warming_now = top
  redis.call('HINCRBY', c.state_key, 'warmings', 1)
end

-- The instance this worker serves next (pick_next); when there is none, nothing normal is ready
-- and intake has gone quiet with work waiting, cleanup mode begins (activation threshold 0, any
-- staged shape is next); when the model is empty, cleanup mode ends. Returns the instance, or nil
-- and the reply ({0, 'wait'} while work waits, in lanes or store segments: c.stored; {0, 'idle'}).
local function next_instance(c, quiet, waiting)
  local inst = pick_next(c, c.cleanup)
  if inst then return inst end
  if quiet and waiting > 0 and not c.cleanup then
    c.cleanup = true
    enter_cleanup(c.state_key, c.now)
    inst = pick_next(c, true)
    if inst then return inst end
  end
  if waiting + c.stored > 0 then return nil, {0, 'wait'} end
  if c.cleanup then exit_cleanup(c.state_key, c.now) end
  return nil, {0, 'idle'}
end
