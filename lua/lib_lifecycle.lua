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
local WORK_FIELDS = {'tokens', 'items', 'in_items', 'in_out', 'state', 'warming_for', 'claimed_ms', 'activated_ms'}
local function inst_work(c, inst)
  local h = hmget_named(inst_key(c.base, inst), WORK_FIELDS)
  local tokens, placed = num(h.tokens), num(h.in_items)
  local mean_out = placed > 0 and num(h.in_out) / placed or 0
  return tokens, tokens + c.cfg.decode_weight * num(h.items) * mean_out, mean_out, h
end

-- Which of two staged instances goes first: the one with the longer decodes (mean output limit),
-- so that a job's end is made of short ones (a worker's last batch decodes for as many steps as its
-- longest output, whatever else the fleet has left); then the one with more work.
local function before(out_a, work_a, out_b, work_b)
  if out_a ~= out_b then return out_a > out_b end
  return work_a > work_b
end

-- The staged instance that goes first (before()) that no other worker is warming (each worker
-- warms one at a time, so at most a fleet's worth are skipped), among the STAGED_LOOK with the most
-- tokens, holding at least `need` tokens: (inst, tokens, work, the work of all it looked at) or nil.
local STAGED_LOOK = 64
local function top_staged(c, need)
  local top = redis.call('ZREVRANGE', c.base .. ':staged', 0, STAGED_LOOK - 1)
  local best, any, sum = nil, nil, 0
  for _, inst in ipairs(top) do
    local tokens, work, out, h = inst_work(c, inst)
    sum = sum + work
    if tokens >= (need or 0) then
      local cand = {inst, tokens, work, out}
      if not any or before(out, work, any[4], any[3]) then any = cand end
      -- a dead worker's reservation (its heartbeat key gone) lapses
      if (not best or before(out, work, best[4], best[3])) and (h.state ~= 'warming' or h.warming_for == c.consumer
          or not h.warming_for or not alive(c.base, h.warming_for)) then
        best = cand
      end
    end
  end
  -- Every staged instance is another worker's next: take the first rather than let it wait on a
  -- worker that may not come back for it soon (its prewarm is lost, nothing else).
  best = best or any
  if best then return best[1], best[2], best[3], sum end
  return nil, 0, 0, 0
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

-- The next shape for this worker (seeds 001, 003, and the fleet of issue 24): an aged one first
-- (no shape waits for ever behind popular ones). Else, as longest-processing-time first does
-- offline, the largest piece of work: an instance left by its workers (dead, preempted) first;
-- then an active instance whose workers hold more than a fair share each (the model's remaining
-- work over its live workers) is joined, the most loaded first, while the share this worker would
-- take of it is no smaller than the staged candidate, so a deep shape ends up split over as many
-- workers as its work deserves; otherwise the staged instance that goes first (top_staged) and
-- holds a full batch (activate_batches 0, or cleanup: anything) starts; with none, the active
-- instance with the most work per worker is joined while it holds a batch beyond one for each of
-- its workers: no worker idles while another's shape holds work it could take, and none joins a
-- shape that is about to be finished, unless its workers took nothing from it for hygiene_idle_ms.
local function pick_next(c, cleanup)
  local cfg, now = c.cfg, c.now
  local old = aged(c)
  if old then
    -- An aged shape is served whatever its fill: it drains at once (late arrivals stage anew).
    activate(c, old, 'aging')
    redis.call('HSET', inst_key(c.base, old), 'state', 'draining', 'draining_ms', now)
    return old
  end
  local actives = redis.call('ZRANGE', c.active_key, 0, -1)
  local n = #actives > 0 and attachments(c) or {}
  local budget = cfg.budget_tokens
  local total = 0
  -- over: the active instance whose workers hold the most work each (load); help: the one with the
  -- most work per worker once this one joins, among those holding a batch beyond one per worker
  local over, load, over_work, help, hshare, stuck = nil, 0, 0, nil, 0, nil
  for _, inst in ipairs(actives) do
    local t, w, _, h = inst_work(c, inst)
    local k = n[inst] or 0
    total = total + w
    if t > 0 then
      if k == 0 then return attach(c, inst) end  -- left by its workers: nothing else serves it
      -- only an instance holding a batch beyond one per worker, this one included, is joined:
      -- none that its workers are about to finish
      local room = t > (k + 1) * budget
      if room and w / k > load then over, load, over_work = inst, w / k, w end
      if room and w / (k + 1) > hshare then help, hshare = inst, w / (k + 1) end
      -- its workers live but took nothing from it for hygiene_idle_ms (gated, or stuck): helped
      if now - math.max(num(h.claimed_ms), num(h.activated_ms)) >= cfg.hygiene_idle_ms then stuck = inst end
    else
      finish(c, inst)  -- emptied, and no live worker serves it
    end
  end
  local need = activation_need(c, cleanup)
  local cand, ctok, cwork, staged_work = nil, 0, 0, 0
  local warming_now = c.warming_now
  if warming_now ~= '' and redis.call('HGET', inst_key(c.base, warming_now), 'state') == 'warming' then
    ctok, cwork = inst_work(c, warming_now)
    if ctok >= need then cand, staged_work = warming_now, cwork end
  end
  local top, ttok, twork, tsum = top_staged(c, need)
  if not cand then cand, ctok, cwork = top, ttok, twork end
  total = total + math.max(staged_work, tsum)
  -- the fleet is counted only when there is a join to weigh: an idle worker's claim stays cheap
  if over and (not cand or over_work / ((n[over] or 0) + 1) >= cwork) and load > total / fleet_size(c) then
    return attach(c, over)
  end
  if cand then
    local why = 'cleanup'
    if cand == warming_now then why = 'warmed'
    elseif ctok >= cfg.activate_batches * budget then why = 'threshold'
    elseif ctok >= budget then why = 'depth' end
    if why == 'cleanup' and not c.cleanup then
      -- below every threshold, started because intake is quiet: the workload's tail (seed 001)
      c.cleanup = true
      enter_cleanup(c.state_key, c.now)
    end
    return activate(c, cand, why)
  end
  if help then return attach(c, help) end
  -- Rather than idle while another worker's instance holds items it has not served for a while,
  -- help it: nothing waits on one worker alone.
  if stuck then return attach(c, stuck) end
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
  -- The shape pick_next would start: one holding a full batch (in cleanup any, however small).
  local top = top_staged(c, activation_need(c, c.cleanup))
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
