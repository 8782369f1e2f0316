-- lib_deliver.lua: how claim.lua moves a planned batch out of its lanes (or the reclaimed queue)
-- into the batch list M:bat:<token>, and delivers it through the consumer group: its entry goes
-- straight into the consumer's pending list (XCLAIM FORCE). Every function takes c, the claim
-- context claim.lua builds (base, state_key, batches_key, reclaimed_key, batch_items_key,
-- consumer, token, cfg, now, st, intake_key, intake, cleanup, warming_now).
-- Keys: M:bat:<token> (written), M:batches (XADD, XCLAIM), M:reclaimed, the taken lanes' three
--   keys, M:inst:S:E and its fill/ready sets, M:state counters (inflight_*, batches,
--   reclaimed_items, cleanup_*, neighbour_fills), M:intake (waiting tokens and items).
-- Invariants: what does not fit stays at the head of its lane (or reclaimed entry), in order; a
--   lane list and its token list lose the same items; the model's counters are written once per
--   batch from the values claim.lua read (scripts are atomic: nothing else moves them meanwhile).
--@include lib.lua
--@include lib_pick.lua
--@include lib_fair.lua
--@include lib_lanes.lua

-- RPUSH of a whole list in slices: unpack() stops near 8,000 values, and an error there would
-- come after the batch's first items had moved (contracts allow 65,536 items).
local function push_all(key, list)
  for s = 1, #list, 2000 do
    redis.call('RPUSH', key, unpack(list, s, math.min(s + 1999, #list)))
  end
end

-- The batch's items are already in the batch list; this records the batch and hands it to the
-- consumer through the group. waiting_tok and waiting_items: how much the model's waiting
-- counters go down (the items left a lane), 0 for reclaimed work; reclaimed: items taken from
-- the reclaimed queue. Returns claim.lua's reply.
local function deliver(c, sig, ep, lane, maxlen, flags, dv, n, waiting_tok, waiting_items, reclaimed)
  local st, state_key = c.st, c.state_key
  -- a batch charged to a tenant carries its tenant and the limit charged per item (lib_fair.lua
  -- charge) for complete.lua's output ratio; a reclaimed batch was counted at its first claim.
  local vtc = c.vtc_entry or {}
  c.vtc_entry = nil
  -- Whole numbers go to Redis as '%d' text: Redis formats a Lua number argument with '%.17g', about
  -- 2.3k instructions, string.format's '%d' a fraction of that (the same digits below 2^53; the
  -- Redis cost notes' eighth pass). The counters go through num(), not a raising `+ 0`: this runs
  -- after the claim's first writes, where a junk field must not stop the script halfway. vtc's limit
  -- is a fraction: it stays a number.
  local fmt = string.format
  local bid = redis.call('XADD', c.batches_key, '*', 'sig', sig, 'ep', fmt('%d', ep), 'lane', fmt('%d', lane),
    'n', fmt('%d', n), 'plen', fmt('%d', pad8(maxlen)), 'w', c.consumer, 'ts', c.now_s, 'k', c.token,
    'dv', fmt('%d', dv), 'fl', fmt('%d', flags), unpack(vtc))
  -- XCLAIM FORCE puts the entry straight into the consumer's pending list (delivery count 1,
  -- the consumer created if new) without reading it back; nothing reads the group with '>'.
  redis.call('XCLAIM', c.batches_key, GROUP, c.consumer, '0', bid, 'FORCE', 'JUSTID')
  redis.call('HSET', state_key, 'inflight_batches', fmt('%d', num(st.inflight_batches) + 1),
    'inflight_items', fmt('%d', num(st.inflight_items) + n), 'batches', fmt('%d', num(st.batches) + 1),
    'reclaimed_items', fmt('%d', num(st.reclaimed_items) - reclaimed))
  if waiting_items > 0 then
    local it = c.intake
    redis.call('HSET', c.intake_key, 'tokens', fmt('%d', num(it.tokens) - waiting_tok),
      'items', fmt('%d', num(it.items) - waiting_items))
  end
  if flags % 2 == 1 then
    redis.call('HINCRBY', state_key, 'cleanup_batches', '1')
    redis.call('HINCRBY', state_key, 'cleanup_items', fmt('%d', n))
  end
  return {1, bid, sig, ep, lane, pad8(maxlen), c.now, flags, dv, n, c.warming_now}
end

-- Pack under the contract: memory mode pads to the longest item rounded up to 8 and counts
-- padded tokens; disk mode counts actual tokens. The first item always goes, so an item
-- larger than the budget travels alone and the runtime answers it instead of it stranding.
local function fits(c, k, maxlen, sum, tok)
  if k == 0 then return true end
  if k >= c.max_items then return false end
  if c.disk then return sum + tok <= c.max_tokens end
  return (k + 1) * pad8(math.max(maxlen, tok)) <= c.max_tokens
end

-- Reclaimed work first (seed 001's assembly order). Reclaimed batches are already pure. An entry
-- is msgpack [sig, epoch, lane, deliveries, tokens, records] (lib_requeue.lua); what does not
-- fit stays at the queue's head. Returns the reply, or nil when the queue is empty.
local function take_reclaimed(c)
  local reclaimed_key = c.reclaimed_key
  local head = redis.call('LINDEX', reclaimed_key, 0)
  if not head then return nil end
  local b = cmsgpack.unpack(head)
  local toks, recs = b[5], b[6]
  local k, maxlen, sum = 0, 0, 0
  while k < #toks and fits(c, k, maxlen, sum, toks[k + 1]) do
    k = k + 1
    maxlen = math.max(maxlen, toks[k])
    sum = sum + toks[k]
  end
  local take, rest_t, rest_r = {}, {}, {}
  for i = 1, #recs do
    if i <= k then take[i] = recs[i] else
      rest_t[#rest_t + 1] = toks[i]
      rest_r[#rest_r + 1] = recs[i]
    end
  end
  if #rest_r == 0 then
    redis.call('LPOP', reclaimed_key)
  else
    b[5], b[6] = rest_t, rest_r
    redis.call('LSET', reclaimed_key, 0, cmsgpack.pack(b))
  end
  push_all(c.batch_items_key, take)
  return deliver(c, b[1], b[2], b[3], maxlen, 2, b[4], k, 0, 0, k)
end

-- Move a planned batch (lib_lanes.lua plan_batch) from its lanes to the batch list and deliver
-- it. info: the instance's fields (inst_info) read in this call.
local function take_batch(c, inst, parts, acc, flags, info)
  local base, cfg, now = c.base, c.cfg, c.now
  local ik = base .. ':inst:' .. inst
  -- whole numbers as '%d' text; the fields read as strings through num(), as in deliver() (after
  -- the lane's items moved, nothing may raise)
  local fmt = string.format
  for i = 1, #parts do
    local seg = parts[i]
    local lane = seg.lane
    local lk = base .. ':lane:' .. inst .. ':' .. lane
    local k = fmt('%d', seg.k)
    if i == 1 then
      -- SORT BY nosort keeps list order and reads only the range it stores: the common batch,
      -- one lane's head, moves lane -> batch list without its bytes entering Lua.
      redis.call('SORT', lk, 'BY', 'nosort', 'LIMIT', '0', k, 'STORE', c.batch_items_key)
      redis.call('LTRIM', lk, k, '-1')
    else
      -- the lane's head taken off and read in one command (LRANGE and LTRIM would be two)
      local popped = redis.call('LMPOP', '1', lk, 'LEFT', 'COUNT', k)
      if popped then push_all(c.batch_items_key, popped[2]) end
    end
    redis.call('LTRIM', base .. ':lanetok:' .. inst .. ':' .. lane, k, '-1')
    local mk = seg.mk
    local left, left_tok = seg.items - seg.k, num(seg.tokens) - seg.sum
    if left <= 0 and now - num(seg.last_ms) >= cfg.lane_quiet_ms then
      retire_lane(c, inst, lane)  -- its keys and index entries go: nothing to update first
    elseif left <= 0 then
      redis.call('ZREM', ik .. ':fill', lane)
      redis.call('ZREM', ik .. ':ready', lane)
      redis.call('HSET', mk, 'items', fmt('%d', left), 'tokens', fmt('%d', left_tok))
      redis.call('HDEL', mk, 'since_ms')
    else
      redis.call('HSET', mk, 'items', fmt('%d', left), 'tokens', fmt('%d', left_tok), 'since_ms', c.now_s)
      if not lane_is_ready(cfg, left, left_tok, seg.rep) then redis.call('ZREM', ik .. ':ready', lane) end
    end
  end
  local first = parts[1].lane
  local inst_tokens = num(info.tokens) - acc.sum
  redis.call('HSET', ik, 'tokens', fmt('%d', inst_tokens), 'items', fmt('%d', num(info.items) - acc.k),
    'batches', fmt('%d', num(info.batches) + 1), 'rr', first, 'taken', fmt('%d', num(info.taken) + acc.sum),
    'claimed_ms', c.now_s)
  inst_written(c, inst)
  if #parts > 1 then redis.call('HINCRBY', c.state_key, 'neighbour_fills', '1') end
  if info.state ~= 'staged' and not c.hot and not c.lent then maybe_warm(c, inst_tokens, info.tenant) end
  -- the tenant's service (lib_fair.lua): padded input tokens and the items' output limits
  local placed = num(info.in_items)
  charge(c, info.tenant, c.disk and acc.sum or acc.k * pad8(acc.maxlen), acc.k,
    placed > 0 and num(info.in_out) / placed or 0)
  local sig, ep = string.match(inst, '^(%x+):(%d+)$')
  return deliver(c, sig, tonumber(ep), tonumber(first), acc.maxlen, flags, 1, acc.k, acc.sum, acc.k, 0)
end

-- Plan and take in one step, whatever the batch's fill (ready lanes, lane hygiene, draining).
local function take_from(c, inst, first, flags, info)
  local parts, acc = plan_batch(c, inst, first)
  if #parts == 0 then return nil end
  return take_batch(c, inst, parts, acc, flags, info)
end
