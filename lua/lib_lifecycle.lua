-- lib_lifecycle.lua: a shape instance's life as claim.lua moves it (seeds 001, 003): staged ->
-- warming -> active -> draining -> finished, and back to staged when aging preempts it; which
-- instance each worker serves (M:affinity) and which it warms next (M:warming).
-- Every function takes c, the claim context claim.lua builds (base, state_key, consumer, cfg,
-- now, st, stored, active_key, affinity_key, warming_key, and the mutable warming_now and cleanup).
-- Keys: M:state (and its cleanup fields, lib_cleanup.lua), M:active, M:affinity, M:warming, M:staged, M:staged_age, M:finished, M:hb:W,
--   M:inst:S:E and its lanes/fill/ready/free/touch sets, M:lane*/lanetok*/lanemeta* of a finished
--   instance.
-- Invariants: a worker serves one instance (its affinity) until it is empty or an aged shape
--   preempts it; each worker warms at most one instance, its next; an instance is finished (its
--   keys deleted) only once empty and served by no live worker.
--@include lib.lua
--@include lib_cleanup.lua
--@include lib_fair.lua

local function inst_key(base, inst) return base .. ':inst:' .. inst end

-- A worker lives while its heartbeat key does (it expires with the worker's TTL).
local function alive(base, worker) return redis.call('EXISTS', base .. ':hb:' .. worker) == 1 end

-- Workers serving each active instance, the claiming one apart; a dead worker's entry (its
-- heartbeat key gone) is dropped. Bounded by the fleet; read only when a worker changes shape.
local function attachments(c)
  local aff = redis.call('HGETALL', c.affinity_key)
  local n = {}
  for i = 1, #aff, 2 do
    if aff[i] ~= c.consumer then
      if alive(c.base, aff[i]) then
        n[aff[i + 1]] = (n[aff[i + 1]] or 0) + 1
      else
        redis.call('HDEL', c.affinity_key, aff[i])
      end
    end
  end
  return n
end

-- An instance's waiting input tokens, and its remaining work in input-token units: those tokens
-- plus decode_weight times its waiting items' output limits (priced at the mean limit of what it
-- took in, lib_intake.lua): what the fleet balances, since decoding, not prefill, fills a GPU's time.
local WORK_FIELDS = {'tokens', 'items', 'in_items', 'in_out', 'state', 'warming_for', 'claimed_ms', 'activated_ms',
  'tenant', 'prio', 'deadline'}
local function inst_work(c, inst)
  local h = hmget_named(inst_key(c.base, inst), WORK_FIELDS)
  local tokens, placed = num(h.tokens), num(h.in_items)
  local mean_out = placed > 0 and num(h.in_out) / placed or 0
  return tokens, tokens + c.cfg.decode_weight * num(h.items) * mean_out, mean_out, h
end

-- Which of two staged instances of one tenant goes first: the one due earlier (a deadline before
-- none; earliest deadline first, issue 26), then the one with the longer decodes (mean output
-- limit), so that a job's end is made of short ones (a worker's last batch decodes for as many
-- steps as its longest output, whatever else the fleet has left), then the one with more work.
-- a, b: {inst, tokens, work, out, deadline}.
local function before(a, b)
  local da, db = a[5], b[5]
  if da ~= db and (da > 0 or db > 0) then return da > 0 and (db == 0 or da < db) end
  if a[4] ~= b[4] then return a[4] > b[4] end
  return a[3] > b[3]
end

-- Whether a staged instance is free for this worker to start: not another live worker's next
-- (each worker warms one at a time, so at most a fleet's worth are skipped).
local function free_for(c, h)
  return h.state ~= 'warming' or h.warming_for == c.consumer or not h.warming_for or not alive(c.base, h.warming_for)
end

-- The staged instance that goes first (before()) of `tenant`'s (any tenant's when nil) that no
-- other worker is warming, among the STAGED_LOOK with the most tokens, holding at least `need`
-- tokens: (inst, tokens, work) or nil. Every staged instance another worker's next: the first
-- rather than let it wait on a worker that may not come back for it soon (its prewarm is lost).
local STAGED_LOOK = 64
local function top_staged(c, need, tenant)
  local best, any = nil, nil
  for _, inst in ipairs(redis.call('ZREVRANGE', c.base .. ':staged', 0, STAGED_LOOK - 1)) do
    local tokens, work, out, h = inst_work(c, inst)
    if tokens >= (need or 0) and (not tenant or (h.tenant or '') == tenant) then
      local cand = {inst, tokens, work, out, num(h.deadline)}
      if not any or before(cand, any) then any = cand end
      if (not best or before(cand, best)) and free_for(c, h) then best = cand end
    end
  end
  best = best or any
  if best then return best[1], best[2], best[3] end
  return nil, 0, 0
end

local function attach(c, inst)
  redis.call('HSET', c.affinity_key, c.consumer, inst)
  return inst
end

-- detached: activated without becoming this worker's shape (interactive work, serve_hot).
local function activate(c, inst, reason, detached)
  local ik = inst_key(c.base, inst)
  redis.call('ZREM', c.base .. ':staged', inst)
  redis.call('ZREM', c.base .. ':staged_age', inst)
  redis.call('HSET', ik, 'state', 'active', 'activated_ms', c.now, 'activated_by', reason)
  redis.call('ZADD', c.active_key, c.now, inst)
  if not detached then attach(c, inst) end
  redis.call('HINCRBY', c.state_key, 'activations', 1)
  if c.warming_now == inst then
    redis.call('HDEL', c.warming_key, c.consumer)
    c.warming_now = ''
  end
  if c.st.warming == inst then redis.call('HDEL', c.state_key, 'warming') end
  return inst
end

-- The staged instance whose oldest item has waited aging_ms, or nil.
local function aged(c)
  if c.cfg.aging_ms <= 0 then return nil end
  local old = redis.call('ZRANGE', c.base .. ':staged_age', 0, 0, 'WITHSCORES')
  if old[1] and c.now - tonumber(old[2]) >= c.cfg.aging_ms then return old[1] end
  return nil
end

-- An emptied instance's keys go, and its batch count joins the thrash alarm's history.
local function finish(c, inst)
  local base, ik = c.base, inst_key(c.base, inst)
  local lanes = redis.call('ZRANGE', ik .. ':lanes', 0, -1)
  for _, lane in ipairs(lanes) do
    redis.call('DEL', base .. ':lane:' .. inst .. ':' .. lane, base .. ':lanetok:' .. inst .. ':' .. lane,
      base .. ':lanemeta:' .. inst .. ':' .. lane)
  end
  local h = hmget_named(ik, {'batches', 'taken'})
  local batches = num(h.batches)
  -- The batches its items could fill under the reference budget: the thrash alarm judges a
  -- shape against them, not against a fixed count alone.
  local could = math.max(1, math.ceil(num(h.taken) / c.cfg.budget_tokens))
  redis.call('DEL', ik, ik .. ':lanes', ik .. ':fill', ik .. ':ready', ik .. ':free', ik .. ':touch')
  redis.call('ZREM', c.active_key, inst)
  redis.call('HDEL', c.affinity_key, c.consumer)
  redis.call('HINCRBY', c.state_key, 'shapes_finished', 1)
  -- Batches-per-shape history for the thrash alarm and its histogram (read by the workers'
  -- maintenance pass, then trimmed).
  redis.call('XADD', base .. ':finished', 'MAXLEN', '~', 10000, '*', 'inst', inst, 'batches', batches,
    'could', could, 'ms', c.now)
end

-- Live workers of the model (registered, heartbeat key present), this one included: the fleet a
-- fair share is counted over. Bounded by the fleet; read only when a worker changes shape.
local function fleet_size(c)
  local n = 1
  for _, w in ipairs(redis.call('HKEYS', c.base .. ':workers')) do
    if w ~= c.consumer and alive(c.base, w) then n = n + 1 end
  end
  return n
end

-- The tokens a staged instance needs to start: a full batch (activate_batches 0: any); in cleanup
-- any. Once intake is quiet (a sealed backlog, or no submit for quiet_ms) no shape grows any more:
-- any too, so that a small shape of long decodes starts early instead of ending the job with its
-- tail (pick_next enters cleanup mode when it starts one below the threshold).
local function activation_need(c, cleanup)
  if cleanup or c.quiet then return 0 end
  return math.min(c.cfg.budget_tokens, c.cfg.activate_batches * c.cfg.budget_tokens)
end

-- What the model holds, per tenant and class, as pick_next weighs it. For each tenant with work
-- waiting (its background work apart, under its own record): the live workers serving it, its
-- remaining work, its active instance whose workers hold the most work each (over: load, over_work,
-- over_k), the one with the most work per worker once one more joins (help), an instance left by its
-- workers (orphan) and its staged candidate (cand: before(), holding at least `need` tokens, this
-- worker's warming one first). Also returns an instance whose workers took nothing from it for
-- hygiene_idle_ms (stuck). Finishes active instances that emptied with no live worker on them.
local function survey(c, need)
  local cfg, now, budget = c.cfg, c.now, c.cfg.budget_tokens
  local actives = redis.call('ZRANGE', c.active_key, 0, -1)
  local n = #actives > 0 and attachments(c) or {}
  local ten, stuck = {}, nil
  local function rec(h)
    local bg = h.prio == 'background'
    local name = h.tenant or ''
    local key = bg and (name .. '|background') or name
    local x = ten[key]
    if not x then
      x = {name = name, bg = bg, workers = 0, work = 0, load = 0, over_work = 0, over_k = 0, hshare = 0}
      ten[key] = x
    end
    return x
  end
  for _, inst in ipairs(actives) do
    local t, w, _, h = inst_work(c, inst)
    local k = n[inst] or 0
    if t > 0 then
      local x = rec(h)
      x.workers, x.work = x.workers + k, x.work + w
      if k == 0 then x.orphan = x.orphan or inst end
      -- only an instance holding a batch beyond one per worker, this one included, is joined:
      -- none that its workers are about to finish
      local room = t > (k + 1) * budget
      if room and k > 0 and w / k > x.load then x.over, x.load, x.over_work, x.over_k = inst, w / k, w, k end
      if room and w / (k + 1) > x.hshare then x.help, x.hshare = inst, w / (k + 1) end
      -- its workers live but took nothing from it for hygiene_idle_ms (gated, or stuck): helped
      if now - math.max(num(h.claimed_ms), num(h.activated_ms)) >= cfg.hygiene_idle_ms then stuck = inst end
    else
      finish(c, inst)  -- emptied, and no live worker serves it
    end
  end
  for _, inst in ipairs(redis.call('ZREVRANGE', c.base .. ':staged', 0, STAGED_LOOK - 1)) do
    local tokens, work, out, h = inst_work(c, inst)
    local x = rec(h)
    x.work = x.work + work
    if tokens >= need then
      local cand = {inst, tokens, work, out, num(h.deadline)}
      local mine = inst == c.warming_now and h.state == 'warming'
      if mine then cand[6] = true end  -- the one this worker prepared for goes first
      if not x.any or before(cand, x.any) then x.any = cand end
      if free_for(c, h) and (not x.cand or x.cand[6] ~= true and (mine or before(cand, x.cand))) then x.cand = cand end
    end
  end
  for _, x in pairs(ten) do x.cand = x.cand or x.any end
  return ten, stuck, n
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
  redis.call('HSET', c.warming_key, c.consumer, top)
  redis.call('HSET', c.state_key, 'warming', top)  -- the latest, for inspect
  c.warming_now = top
  redis.call('HINCRBY', c.state_key, 'warmings', 1)
end

-- Aging preemption: this worker leaves its instance for an aged one; served by no other worker,
-- the instance steps back to staged (lanes and items intact), re-dated so it does not preempt
-- straight back.
local function preempt(c, inst)
  redis.call('HDEL', c.affinity_key, c.consumer)
  if (attachments(c)[inst] or 0) > 0 then return end
  local ik = inst_key(c.base, inst)
  redis.call('HSET', ik, 'state', 'staged', 'preempted_ms', c.now)
  redis.call('ZADD', c.base .. ':staged', num(redis.call('HGET', ik, 'tokens')), inst)
  redis.call('ZADD', c.base .. ':staged_age', c.now, inst)
  redis.call('ZREM', c.active_key, inst)
  redis.call('HINCRBY', c.state_key, 'preemptions', 1)
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
