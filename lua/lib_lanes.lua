-- lib_lanes.lua: how claim.lua plans a batch from a shape instance's lanes (seed 002), reading
-- only, and retires an emptied lane. Every function takes c, the claim context claim.lua builds
-- (base, state_key, disk, max_items, max_tokens).
-- Keys: M:inst:S:E:fill (read), M:lanemeta:S:E:L and M:lanetok:S:E:L (read); retire_lane also
--   M:inst:S:E:lanes/fill/ready/touch/free, the lane's three keys, and M:state lanes_retired.
-- Invariants: a batch holds items of one instance, from one lane or from neighbouring lanes in
--   length order, padded to the rep of the longest lane taken (memory mode); the first item
--   always goes, so an item larger than the budget travels alone rather than stranding; the
--   lanes looked at are bounded by the batch (each gives at least one item or closes it), or,
--   choosing where a batch starts (densest_lane), by DENSE_LANES.
--@include lib.lua

local function retire_lane(c, inst, lane)
  local base = c.base
  local ik = base .. ':inst:' .. inst
  redis.call('ZREM', ik .. ':lanes', lane)
  redis.call('ZREM', ik .. ':fill', lane)
  redis.call('ZREM', ik .. ':ready', lane)
  redis.call('ZREM', ik .. ':touch', lane)
  redis.call('DEL', base .. ':lane:' .. inst .. ':' .. lane, base .. ':lanetok:' .. inst .. ':' .. lane,
    base .. ':lanemeta:' .. inst .. ':' .. lane)
  redis.call('SADD', ik .. ':free', lane)
  redis.call('HINCRBY', c.state_key, 'lanes_retired', 1)
end

-- Plan one lane's part of a batch: read its token list (never more than the batch can still
-- take) and add items while they fit. acc carries the batch so far: k, maxlen, sum, full.
-- Memory mode pads a batch to the rep of the longest lane it takes from (the rep bounds every
-- item: lanes only grow), so each lane keeps one padded length: its graph is built once, and
-- ahead of time by the pre-warm signal, which names the lanes' padded reps.
-- Returns the lane's part {lane, k, sum, mk, rep, items, tokens, last_ms} or nil (tokens and last_ms as read).
local function plan_lane(c, inst, lane, acc)
  local disk, max_items, max_tokens = c.disk, c.max_items, c.max_tokens
  local mk = c.base .. ':lanemeta:' .. inst .. ':' .. lane
  -- the lane's fields go into the part itself (take_batch reads tokens and last_ms), no table of
  -- their own; rep and items through num(), never a raising `+ 0` (a claim may have written before it
  -- plans: an activation, a sweep)
  local m = redis.call('HMGET', mk, 'rep', 'last_ms', 'items', 'tokens')
  local rep, items = num(m[1]), num(m[3])
  -- min, max and floor written out (a C call each costs about ten VM instructions; this runs for
  -- every lane a batch takes): the same numbers for the whole numbers these are
  local room = max_items - acc.k
  if not disk then
    local mx = acc.maxlen
    if rep > mx then mx = rep end
    local plen = pad8(mx)
    -- The first item always goes: one larger than the budget travels alone. plen 0 (no rep):
    -- no bound, as floor(max_tokens / 0) was.
    if plen > 0 then
      local cap = max_tokens / plen
      cap = cap - cap % 1
      if acc.k == 0 and cap < 1 then cap = 1 end
      cap = cap - acc.k
      if cap < room then room = cap end
    end
  end
  if room <= 0 then
    acc.full = true
    return nil
  end
  local want = items < room and items or room
  if want <= 0 then return nil end
  -- a whole number sent as '%d' text: Redis formats a Lua number argument with '%.17g' (about 2.3k
  -- instructions, the eighth pass)
  local toks = redis.call('LRANGE', c.base .. ':lanetok:' .. inst .. ':' .. lane, '0', string.format('%d', want - 1))
  local k, sum, mx = acc.k, 0, 0
  -- submit.lua wrote each as digits: `+` converts it once, where tonumber makes two. Memory mode
  -- takes every token read (room bounded the LRANGE) and pads to the rep: only their sum is needed.
  if not disk then
    for i = 1, #toks do sum = sum + toks[i] end
    k = k + #toks
  end
  for i = 1, disk and #toks or 0 do
    local tok = toks[i] + 0
    if k > 0 and acc.sum + sum + tok > max_tokens then
      acc.full = true
      break
    end
    k = k + 1
    sum = sum + tok
    if tok > mx then mx = tok end
  end
  if k == acc.k then return nil end
  local seg = {lane = lane, k = k - acc.k, sum = sum, mk = mk, rep = rep, items = items, tokens = m[4], last_ms = m[2]}
  acc.k, acc.sum = k, acc.sum + sum
  local top = disk and mx or rep
  if top > acc.maxlen then acc.maxlen = top end
  if k >= max_items or (not disk and (k + 1) * pad8(acc.maxlen) > max_tokens) then acc.full = true end
  return seg
end

-- Plan a batch of one instance: from lane `first` when given (a ready lane, or a lane hygiene
-- drains), then, while the batch is not full, from the neighbouring non-empty lanes above it in
-- length order (the fill index scores each by its rep); without `first`, from the shortest lane
-- up. Padded to the longest item taken, like a cut of the instance's items sorted by length.
-- Reads only. Returns the parts (plan_lane's) and acc {k, maxlen, sum, full}.
local function plan_batch(c, inst, first)
  local ik = c.base .. ':inst:' .. inst
  local acc = {k = 0, maxlen = 0, sum = 0, full = false}
  local parts = {}
  local from = 0
  if first then
    local seg = plan_lane(c, inst, first, acc)
    if seg then parts[1] = seg end
    if acc.full then return parts, acc end
    from = redis.call('ZRANK', ik .. ':fill', first)
    if not from then return parts, acc end
    from = from + 1
  end
  while not acc.full do
    local lanes = redis.call('ZRANGE', ik .. ':fill', string.format('%d', from), string.format('%d', from + 15))
    if #lanes == 0 then break end
    for i = 1, #lanes do
      local lane = lanes[i]
      if lane ~= first then
        local seg = plan_lane(c, inst, lane, acc)
        if seg then parts[#parts + 1] = seg end
        if acc.full then break end
      end
    end
    from = from + #lanes
  end
  return parts, acc
end

-- The lane a batch filled across lanes should start from while its shape's later items wait in
-- the disk tier's store (issue 37): the start whose full batch (that lane and its neighbours above,
-- as plan_batch takes them) pads least per item, judged from the lanes' counts (a partly taken
-- lane at its mean length). Taking the shortest lanes first there leaves Redis holding a shape's
-- long items while each fed segment's short ones go in sparse, wide batches; taking the densest
-- run keeps every batch narrow, as a whole shape in Redis does. Memory mode only (a disk-mode
-- batch pads to its own longest item, not a lane's rep). Reads only: the shortest DENSE_LANES
-- lanes at most, so a claim's work stays bounded (the ceiling bounds a shape's lanes anyway: at
-- 4 M tokens a served shape held 85 to 117); nil when no start gives a full batch (the caller
-- starts from the shortest lane).
local DENSE_LANES = 200
local function densest_lane(c, inst)
  if c.disk then return nil end
  local base = c.base
  local raw = redis.call('ZRANGE', base .. ':inst:' .. inst .. ':fill', 0, DENSE_LANES - 1, 'WITHSCORES')
  local n = #raw / 2
  if n < 2 then return nil end
  local ids, plens, items, toks = {}, {}, {}, {}
  local mk = base .. ':lanemeta:' .. inst .. ':'
  for j = 1, n do
    local id = raw[2 * j - 1]
    ids[j], plens[j] = id, pad8(tonumber(raw[2 * j]))
    local m = redis.call('HMGET', mk .. id, 'items', 'tokens')
    items[j], toks[j] = num(m[1]), num(m[2])
  end
  local max_items, max_tokens = c.max_items, c.max_tokens
  local best, best_cost = nil, nil
  for s = 1, n do
    local k, sum = 0, 0
    for j = s, n do
      local cap = math.max(1, math.min(max_items, math.floor(max_tokens / plens[j])))  -- the first item always goes
      local cost = nil
      if cap <= k then
        cost = (k * plens[j - 1] - sum) / k  -- full at the lane below: this one's rep does not fit
      elseif k + items[j] >= cap then
        local take = cap - k
        cost = (cap * plens[j] - sum - toks[j] * take / items[j]) / cap
      end
      if cost then
        if not best_cost or cost < best_cost then best, best_cost = ids[s], cost end
        break
      end
      k, sum = k + items[j], sum + toks[j]
    end
  end
  return best
end
