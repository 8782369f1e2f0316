-- lib_rebalance.lua: the fair share between tenants as a claim applies it (issue 26, lib_fair.lua
-- keeps the counters): a worker whose tenant leads lends another tenant one batch (lend) or leaves
-- its shape for that tenant's work (rebalance). Every function takes c, the claim context
-- claim.lua builds.
-- Keys: M:state fair_loans and fair_switches; through lib_serve.lua, lib_pick.lua, lib_survey.lua,
--   lib_fair.lua and lib_deliver.lua what they touch.
-- Invariant: a loan takes one full batch of a shape another worker already serves and keeps this
--   worker's own shape (its affinity); a switch leaves the shape as aging preempts it (its lanes
--   stay) and goes back to it when the other tenant has nothing to take after all.
--@include lib.lua
--@include lib_fair.lua
--@include lib_workers.lua
--@include lib_lifecycle.lua
--@include lib_survey.lua
--@include lib_pick.lua
--@include lib_deliver.lua
--@include lib_serve.lua

-- FAIR_GAP_BATCHES of this worker's batches' worth of service, in its tenant's counter's units: how
-- far its tenant may lead before this worker lends one behind a batch (lend: a switch to a shape
-- another worker serves and back; the issue's bound on the service gap is two batches). 1.5 when a
-- lending moved the worker for good: 1 then cost 0.94x first-come under the static model; with
-- loans it costs 0.98x (bench/RESULTS.md, fairness notes).
local FAIR_GAP_BATCHES = 1.0
local function fair_gap(c, info)
  -- num(), never a raising `+ 0`: a claim may have written before it weighs a loan
  local placed, items = num(info.in_items), num(info.items)
  local mean_out = placed > 0 and num(info.in_out) / placed or 0
  -- a batch of this instance as claim charges it (lib_fair.lua charge): its items' padded tokens
  -- under this worker's contract, and the output expected of their limits
  local per_item = items > 0 and pad8(math.ceil(num(info.tokens) / items)) or c.max_tokens
  local n = math.max(1, math.min(c.max_items, math.floor(c.max_tokens / per_item)))
  local tenant = info.tenant or ''
  local expect = mean_out * (tenant ~= '' and out_ratio(c, tenant) or 1)
  return FAIR_GAP_BATCHES * n * (per_item + c.cfg.decode_weight * expect) / tenant_weight(c, tenant)
end

-- A fair loan (rebalance): one full batch of an active instance of tenant record x (the one whose
-- workers hold the most work each, else the one another worker would join), taken without this
-- worker leaving its own shape (its affinity stays, as for interactive work): a tenant behind in
-- service gets a batch at once from a shape some worker already serves, instead of a worker moved to
-- another shape for good. Returns the reply, or nil when no such instance holds a full batch.
local function lend(c, x)
  local inst = x.over or x.help
  if not inst then return nil end
  local info = inst_info(c, inst)
  if info.state ~= 'active' then return nil end
  indexed(c, inst, info)
  local ik = inst_key(c.base, inst)
  local lane = redis.call('ZRANGE', ik .. ':ready', '0', '0')[1]
  local parts, acc = plan_batch(c, inst, lane)
  if #parts == 0 or not (lane or acc.full) then return nil end
  c.lent = true
  redis.call('HINCRBY', c.state_key, 'fair_loans', 1)
  return take_batch(c, inst, parts, acc, c.cleanup and 1 or 0, info)
end

-- Fair share between tenants (issue 26, lib_fair.lua), swept with aging and checked between sweeps
-- when this worker's tenant leads (fair_due): the returning tenants'
-- counters are lifted; then, if this worker's tenant holds a whole worker more than its share while
-- another waiting tenant lacks one (and is not ahead in service), this worker leaves its instance
-- (as aging preempts it: its lanes stay, another worker or a later claim serves it) for that
-- tenant's work. If instead this worker's tenant leads one no better staffed by more than
-- FAIR_GAP_BATCHES of its batches' worth of service, this worker lends that tenant one batch of an
-- active instance of its (lend: no shape of its own given up, the next claim checks again), and
-- leaves its instance for that tenant's work only when none holds a full batch.
-- Returns the instance to serve and its fields, and the loaned batch's reply when it lent one.
local function rebalance(c, inst, info)
  if info.state ~= 'active' then return inst, info end
  local ten = survey(c, activation_need(c, c.cleanup))
  local names, keys, fg = {}, {}, {}
  for key, x in pairs(ten) do
    if not x.bg then
      keys[#keys + 1] = key
      names[#names + 1] = x.name
      fg[key] = x
    end
  end
  if #keys < 1 then return inst, info end
  local vtc = counters(c, names)
  lift_returning(c, names, vtc)
  if #keys < 2 then return inst, info end
  local mine = info.tenant or ''
  if ten[mine] then ten[mine].workers = ten[mine].workers + 1 end  -- this worker, left out of attachments
  local def = deficits(c, fg, fleet_size(c))
  local dmine = def[mine]
  if not dmine then return inst, info end
  local gap = fair_gap(c, info)
  local to, best, moved = nil, nil, false
  for _, key in ipairs(keys) do
    local x = ten[key]
    if key ~= mine and (x.cand or x.help or x.orphan) then
      local lead = vtc[mine] - vtc[x.name]
      -- a whole worker too many for one a whole worker short, unless that would serve a tenant
      -- already ahead in service
      local short = dmine <= -1 + 1e-9 and def[key] >= 1 - 1e-9 and lead > -gap
      -- service, not workers, is what is shared: a tenant whose counter leads one no better staffed
      -- (for its weight) by two batches' worth lends it this worker, whatever the staffing says
      local behind = def[key] >= dmine - 1e-9 and lead > gap
      local better = not best or def[key] > best or (def[key] == best and vtc[x.name] < vtc[ten[to].name])
      if (short or behind) and better then
        to, best, moved = key, def[key], short
      end
    end
  end
  if not to then return inst, info end
  if not moved then
    -- behind, not short of a worker: one batch of its busiest active instance, this worker's shape kept
    local r = lend(c, ten[to])
    if r then return inst, info, r end
  end
  preempt(c, inst)
  redis.call('HINCRBY', c.state_key, 'fair_switches', 1)
  local nxt = pick_next(c, c.cleanup, ten[to].name)
  if not nxt then  -- nothing it could take after all: back to its own shape
    activate(c, inst, 'fair')
    return inst, inst_info(c, inst)
  end
  info = inst_info(c, nxt)
  indexed(c, nxt, info)
  return nxt, info
end
