-- lib_fair.lua: fair share between the tenants whose work waits on a model (issue 26), as claim.lua
-- uses it. A tenant's share of the fleet is its weight (M:tenants, `conductor tenant T --weight W`,
-- default 1) over the weights of every tenant with work waiting; a tenant's service is a virtual
-- token counter (M:vtc: what its batches cost, padded input tokens plus decode_weight times the
-- output expected of their limits, over its weight, charged at claim), lifted on its return to the smallest counter
-- of the tenants already waiting, so that idle time earns no credit (the Virtual Token Counter of
-- Sheng et al., OSDI 2024). Every function takes c, the claim context claim.lua builds.
-- Keys: M:tenants (read), M:vtc (tenant -> virtual tokens; HINCRBYFLOAT, HSET), M:vtc_ratio ("T:lim",
--   "T:out": limits charged and output reported, recent; HMGET, HINCRBYFLOAT, HSET), M:vtc_seen
--   (tenant -> the number of the last fair check that saw its work waiting; '#': checks so far).
-- Invariants: a counter only grows (a charge, or a lift to another waiting tenant's counter); a
--   tenant's weight is at least a thousandth (0 or garbage reads as 1).
--@include lib.lua

-- A tenant's weight, read once per claim.
local function tenant_weight(c, tenant)
  c.weights = c.weights or {}
  local w = c.weights[tenant]
  if not w then
    w = tonumber(redis.call('HGET', c.base .. ':tenants', tenant) or '') or 1
    if w ~= w or w < 0.001 then w = 1 end
    c.weights[tenant] = w
  end
  return w
end

-- What a tenant's items produced of the output limits charged for them (M:vtc_ratio "T:out" over
-- "T:lim", counted by complete.lua (lib_service.lua count_output_ratio), halved as they grow so that the ratio
-- follows recent work). Until the tenant has RATIO_MIN_LIMITS of its own, the model's ("#": every
-- tenant's), so that a tenant whose first results have not come back is priced as the others are,
-- not at its full limits; 1 before any result. Clamped: a limit is a mean.
-- Read once per claim and tenant, as the weight is: a claim's fair check (fair_gap) and its charge
-- ask of the same tenant, and no claim writes M:vtc_ratio (complete.lua does).
local RATIO_MIN_LIMITS = 4000
local function out_ratio(c, tenant)
  c.ratios = c.ratios or {}
  local r = c.ratios[tenant]
  if r then return r end
  local v = redis.call('HMGET', c.base .. ':vtc_ratio', tenant .. ':lim', tenant .. ':out', '#:lim', '#:out')
  -- num(), never a raising `+ 0`: a claim reads this after its first writes (the charge, in take_batch)
  local lim, out = num(v[1]), num(v[2])
  if lim < RATIO_MIN_LIMITS then lim, out = num(v[3]), num(v[4]) end
  r = lim < 1 and 1 or math.min(2, math.max(0.05, out / lim))
  c.ratios[tenant] = r
  return r
end

-- What one batch costs its tenant's counter at claim: padded input tokens plus decode_weight times
-- the output its items are expected to produce (the instance's mean limit times the tenant's
-- out_ratio), over the tenant's weight. The batch's stream entry carries the tenant and the limit
-- charged (c.vtc_entry, lib_deliver.lua deliver) for complete.lua to count the output against.
-- Priced by limits alone, a tenant whose items stop shorter of max_tokens than another's paid for
-- tokens it never got; trued up at complete instead, a counter moved late by the batches in flight
-- (both measured: bench/RESULTS.md, fairness notes).
local function charge(c, tenant, padded, items, mean_out)
  if not tenant or tenant == '' then return end
  local cost = (padded + c.cfg.decode_weight * items * mean_out * out_ratio(c, tenant)) / tenant_weight(c, tenant)
  redis.call('HINCRBYFLOAT', c.base .. ':vtc', tenant, cost)
  c.vtc_entry = {'tn', tenant, 'vl', mean_out}
end

-- The counters of these tenants: {tenant -> virtual tokens}.
local function counters(c, tenants)
  local out = {}
  if #tenants == 0 then return out end
  local v = redis.call('HMGET', c.base .. ':vtc', unpack(tenants))
  for i, t in ipairs(tenants) do out[t] = tonumber(v[i] or '') or 0 end
  return out
end

-- The lift, at each fair check (lib_rebalance.lua rebalance): a tenant whose work waits now and did
-- not at the previous check comes back: its counter rises to the smallest counter of the tenants
-- that were waiting already. M:vtc_seen holds, per tenant, the number of the last check that saw
-- its work waiting (field '#': the checks so far). vtc: counters(); waiting: tenant names.
local function lift_returning(c, waiting, vtc)
  local seen_key = c.base .. ':vtc_seen'
  local check = redis.call('HINCRBY', seen_key, '#', 1)
  local seen = redis.call('HMGET', seen_key, unpack(waiting))
  local floor, back = nil, {}
  for i, t in ipairs(waiting) do
    if (tonumber(seen[i] or '') or -1) < check - 1 then
      back[#back + 1] = t
    elseif not floor or vtc[t] < floor then
      floor = vtc[t]
    end
  end
  if floor then
    for _, t in ipairs(back) do
      if vtc[t] < floor then
        redis.call('HSET', c.base .. ':vtc', t, floor)
        vtc[t] = floor
      end
    end
  end
  local stamp = {}
  for _, t in ipairs(waiting) do stamp[#stamp + 1] = t; stamp[#stamp + 1] = check end
  redis.call('HSET', seen_key, unpack(stamp))
end

-- Whether a fair check is due at this claim, between sweeps: this worker's tenant's counter leads
-- the smallest counter of the tenants the last check saw waiting by more than `gap` (two of reads,
-- small hashes: every claim can afford them).
local function fair_due(c, tenant, gap)
  local seen = redis.call('HGETALL', c.base .. ':vtc_seen')
  local check, names = nil, {}
  for i = 1, #seen, 2 do
    if seen[i] == '#' then check = tonumber(seen[i + 1]) else names[#names + 1] = seen[i] end
  end
  if not check or #names < 2 then return false end
  local waiting = {}
  for i = 1, #seen, 2 do
    if seen[i] ~= '#' and tonumber(seen[i + 1]) == check then waiting[#waiting + 1] = seen[i] end
  end
  if #waiting < 2 then return false end
  local vtc = counters(c, waiting)
  local low = math.huge
  for _, t in ipairs(waiting) do if vtc[t] < low then low = vtc[t] end end
  return (vtc[tenant] or low) - low > gap
end

-- Workers each waiting tenant deserves: the fleet times its weight over the waiting tenants'
-- weights. tenants: {key -> record with .name (the tenant) and .workers}; returns {key -> deficit
-- (workers deserved minus workers serving it)}.
local function deficits(c, tenants, fleet)
  local sum = 0
  for _, x in pairs(tenants) do sum = sum + tenant_weight(c, x.name) end
  local out = {}
  for key, x in pairs(tenants) do out[key] = fleet * tenant_weight(c, x.name) / sum - x.workers end
  return out
end
