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
local function inst_work(c, inst)
  local h = redis.call('HMGET', inst_key(c.base, inst), 'tokens', 'items', 'in_items', 'in_out')
  local tokens, placed = num(h[1]), num(h[3])
  local mean_out = placed > 0 and num(h[4]) / placed or 0
  return tokens, tokens + c.cfg.decode_weight * num(h[2]) * mean_out, mean_out
end

-- The staged instance with the most work that no other worker is warming (each worker warms one
-- at a time, so at most a fleet's worth are skipped), among the STAGED_LOOK with the most tokens:
-- (inst, tokens, work) or nil.
local STAGED_LOOK = 16
local LAT_FIRST = true
local function top_staged(c)
  local top = redis.call('ZREVRANGE', c.base .. ':staged', 0, STAGED_LOOK - 1)
  local best, btok, bwork, bkey, any, atok, awork, akey = nil, 0, -1, -1, nil, 0, -1, -1
  for _, inst in ipairs(top) do
    local tokens, work, out = inst_work(c, inst)
    local key = LAT_FIRST and (out * 1e12 + work) or work
    if key > akey then any, atok, awork, akey = inst, tokens, work, key end
    local h = hmget_named(inst_key(c.base, inst), {'state', 'warming_for'})
    -- a dead worker's reservation (its heartbeat key gone) lapses
    if key > bkey and (h.state ~= 'warming' or h.warming_for == c.consumer or not h.warming_for
        or not alive(c.base, h.warming_for)) then
      best, btok, bwork, bkey = inst, tokens, work, key
    end
  end
  if best then return best, btok, bwork end
  -- Every staged instance is another worker's next: take the largest rather than let it wait
  -- on a worker that may not come back for it soon (its prewarm is lost, nothing else).
  if any then return any, atok, awork end
  return nil, 0, 0
end

local function attach(c, inst)
  redis.call('HSET', c.affinity_key, c.consumer, inst)
  return inst
end

local function activate(c, inst, reason)
  local ik = inst_key(c.base, inst)
  redis.call('ZREM', c.base .. ':staged', inst)
  redis.call('ZREM', c.base .. ':staged_age', inst)
  redis.call('HSET', ik, 'state', 'active', 'activated_ms', c.now, 'activated_by', reason)
  redis.call('ZADD', c.active_key, c.now, inst)
  attach(c, inst)
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

-- The next shape for this worker: an aged one first (no shape waits for ever behind popular
-- ones); else the larger of the next staged instance (the warming one, which prepared for the
-- switch, or the one with the most tokens) once it holds activate_batches budgets, and an
-- active instance's tokens per worker serving it (sharing it); else, rather than idle, a
-- staged instance or a share holding one full batch; in cleanup any staged one; else any share.
local function pick_next(c, cleanup)
  local cfg, now = c.cfg, c.now
  local old = aged(c)
  if old then
    -- An aged shape is served whatever its fill: it drains at once (late arrivals stage anew).
    activate(c, old, 'aging')
    redis.call('HSET', inst_key(c.base, old), 'state', 'draining', 'draining_ms', now)
    return old
  end
  local n = attachments(c)
  -- best: the active instance with the most work per worker serving it once this one joins
  -- (share: its tokens per worker, for the thresholds; wshare: its work per worker, for the choice)
  local best, share, wshare = nil, 0, 0
  for _, inst in ipairs(redis.call('ZRANGE', c.active_key, 0, -1)) do
    local t, w = inst_work(c, inst)
    local k = (n[inst] or 0) + 1
    if t > 0 and w / k > wshare then
      best, share, wshare = inst, t / k, w / k
    elseif t <= 0 and not n[inst] then
      finish(c, inst)  -- emptied while its last worker was away (it died or was preempted)
    end
  end
  local cand, ctok, cwork = nil, 0, 0
  local warming_now = c.warming_now
  if warming_now ~= '' and redis.call('HGET', inst_key(c.base, warming_now), 'state') == 'warming' then
    cand = warming_now
    ctok, cwork = inst_work(c, cand)
  else
    cand, ctok, cwork = top_staged(c)
  end
  local why = cand == warming_now and 'warmed' or 'threshold'
  local budget = cfg.budget_tokens
  if cand and ctok >= cfg.activate_batches * budget and cwork >= wshare then return activate(c, cand, why) end
  if best and share >= cfg.activate_batches * budget then return attach(c, best) end
  if cand and ctok >= budget and cwork >= wshare then return activate(c, cand, 'depth') end
  if best and share >= budget then return attach(c, best) end
  if cleanup and cand then return activate(c, cand, 'cleanup') end
  -- Rather than idle while another worker's instance holds items (that worker may be gated or
  -- stuck), help it: nothing waits on one worker alone.
  if best then return attach(c, best) end
  return nil
end

-- Pre-warm (seed 003): when the active instance runs low, mark the staged instance with the
-- most tokens (at least one full batch) as warming (one at a time) and tell the workers,
-- so graphs and caches are ready before the switch.
local function maybe_warm(c, inst_tokens)
  local cfg = c.cfg
  if inst_tokens >= cfg.prewarm_batches * cfg.budget_tokens then return end
  local cur = c.warming_now
  if cur ~= '' and redis.call('HGET', inst_key(c.base, cur), 'state') == 'warming' then return end
  local top, tokens = top_staged(c)
  -- One full batch is enough: a worker with nothing else activates such a shape (pick_next);
  -- in cleanup any shape is next, however small.
  if not top or (tokens < cfg.budget_tokens and not c.cleanup) then return end
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
