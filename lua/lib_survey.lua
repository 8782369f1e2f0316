-- lib_survey.lua: what waits, as claim.lua weighs it (seeds 001, 003, issues 24 and 26): each
-- instance's remaining work, the staged instance that goes first, and per tenant the instances its
-- workers serve. Every function takes c, the claim context claim.lua builds.
-- Keys: M:inst:S:E (HMGET, HGET), M:staged (ZREVRANGE), M:active (ZRANGE); through lib_workers.lua and
--   lib_lifecycle.lua (finish) what they touch.
-- Invariant: reads only, but for an emptied active instance no live worker serves, which survey
--   finishes; at most STAGED_LOOK staged instances are looked at, so the work is bounded by that
--   and the fleet, never by the queue.
--@include lib.lua
--@include lib_workers.lua
--@include lib_lifecycle.lua

-- An instance's waiting input tokens, and its remaining work in input-token units: those tokens
-- plus decode_weight times its waiting items' output limits (priced at the mean limit of what it
-- took in, lib_intake.lua): what the fleet balances, since decoding, not prefill, fills a GPU's time.
-- A staged instance's fields, and an active one's: only those present on such an instance, since a
-- missing field costs HMGET a scan of the whole hash (survey reads up to STAGED_LOOK of them per
-- call); warming_for is read by free_for, only for a warming instance.
local ACTIVE_FIELDS = {'tokens', 'items', 'in_items', 'in_out', 'state', 'tenant', 'prio', 'claimed_ms', 'activated_ms'}

-- A staged instance's fields, read once a call: a claim that switches shape weighs the same
-- STAGED_LOOK staged instances in survey and again in the pre-warm pick (top_staged), and each read
-- costs the server a command and its reply made Lua strings (bench/RESULTS.md, the Redis cost notes'
-- fifth pass). c.work holds them by instance; every write to an instance's hash in claim.lua's
-- includes calls inst_written (lib_lifecycle.lua), which drops it, so a later read is fresh. The
-- table is built whole (a constructor sizes it once; naming fields one by one grows it four times).
local function staged_fields(c, inst)
  local h = c.work[inst]
  if h then return h end
  local r = redis.call('HMGET', c.base .. ':inst:' .. inst, 'tokens', 'items', 'in_items', 'in_out', 'state', 'tenant',
    'prio', 'deadline')
  h = {tokens = r[1], items = r[2], in_items = r[3], in_out = r[4], state = r[5], tenant = r[6], prio = r[7],
    deadline = r[8], inst = inst}
  c.work[inst] = h
  return h
end

-- fields: ACTIVE_FIELDS for an active instance; nil for a staged one (staged_fields). A staged
-- instance's figures and deadline are kept in h with its fields (survey and top_staged weigh the
-- same ones; inst_written drops both). The counters go through num(), never a raising `+ 0`: a
-- survey runs after the claim's first writes (an affinity, a sweep, finish() in its own loop).
local function inst_work(c, inst, fields)
  local h
  if fields then
    h = hmget_named(inst_key(c.base, inst), fields)
    h.inst = inst
  else
    h = staged_fields(c, inst)
    if h.t then return h.t, h.w, h.o, h end
  end
  local tokens, placed = num(h.tokens), num(h.in_items)
  local mean_out = placed > 0 and num(h.in_out) / placed or 0
  local work = tokens + c.cfg.decode_weight * num(h.items) * mean_out
  -- a staged instance's deadline (0: none) too: survey and top_staged compare by it (before())
  if not fields then h.t, h.w, h.o, h.dl = tokens, work, mean_out, num(h.deadline) end
  return tokens, work, mean_out, h
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
-- (each worker warms one at a time, so at most a fleet's worth are skipped). Kept in h (staged_fields'
-- table, dropped with it by inst_written): survey and top_staged ask it of the same instances.
local function free_for(c, h)
  if h.state ~= 'warming' then return true end
  if h.free == nil then
    local by = redis.call('HGET', c.base .. ':inst:' .. h.inst, 'warming_for')
    h.free = by == c.consumer or not by or not alive(c, by)
  end
  return h.free
end

-- The staged instance that goes first (before()) of `tenant`'s (any tenant's when nil) that no
-- other worker is warming, among the STAGED_LOOK with the most tokens, holding at least `need`
-- tokens: (inst, tokens, work) or nil. Every staged instance another worker's next: the first
-- rather than let it wait on a worker that may not come back for it soon (its prewarm is lost).
-- STAGED_LOOK is 64: the ZREVRANGE's last index, as text (a Lua number argument costs Redis a '%.17g'
-- format: the Redis cost notes' eighth pass)
local STAGED_LAST = '63'
-- Read once until the claim changes M:staged (activate and preempt, lib_lifecycle.lua, clear
-- c.staged_top): survey and the pre-warm pick after it ask the same ZREVRANGE, 64 names a reply.
local function staged_top(c)
  local s = c.staged_top
  if not s then
    s = redis.call('ZREVRANGE', c.base .. ':staged', '0', STAGED_LAST)
    c.staged_top = s
  end
  return s
end
local function top_staged(c, need, tenant)
  local best, any = nil, nil
  local staged = staged_top(c)
  for i = 1, #staged do
    local inst = staged[i]
    local tokens, work, out, h = inst_work(c, inst)
    if tokens >= (need or 0) and (not tenant or (h.tenant or '') == tenant) then
      local cand = {inst, tokens, work, out, h.dl}
      if not any or before(cand, any) then any = cand end
      if (not best or before(cand, best)) and free_for(c, h) then best = cand end
    end
  end
  best = best or any
  if best then return best[1], best[2], best[3] end
  return nil, 0, 0
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
-- (Numeric loops here and in top_staged: ipairs' iterator is a C call an instance.)
local function survey(c, need)
  local cfg, now, budget = c.cfg, c.now, c.cfg.budget_tokens
  local actives = redis.call('ZRANGE', c.active_key, '0', '-1')
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
  for i = 1, #actives do
    local inst = actives[i]
    local t, w, _, h = inst_work(c, inst, ACTIVE_FIELDS)
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
      local cl, ac = num(h.claimed_ms), num(h.activated_ms)
      if now - (cl > ac and cl or ac) >= cfg.hygiene_idle_ms then stuck = inst end
    else
      finish(c, inst)  -- emptied, and no live worker serves it
    end
  end
  local staged = staged_top(c)
  for i = 1, #staged do
    local inst = staged[i]
    local tokens, work, out, h = inst_work(c, inst)
    local x = rec(h)
    x.work = x.work + work
    if tokens >= need then
      local cand = {inst, tokens, work, out, h.dl}
      local mine = inst == c.warming_now and h.state == 'warming'
      if mine then cand[6] = true end  -- the one this worker prepared for goes first
      if not x.any or before(cand, x.any) then x.any = cand end
      if free_for(c, h) and (not x.cand or x.cand[6] ~= true and (mine or before(cand, x.cand))) then x.cand = cand end
    end
  end
  for _, x in pairs(ten) do x.cand = x.cand or x.any end
  return ten, stuck, n
end
