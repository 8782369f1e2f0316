-- lib_lifecycle.lua: a shape instance's moves as claim.lua makes them (seeds 001, 003): staged ->
-- active (activate), active -> staged when aging preempts it (preempt), emptied -> finished (finish).
-- Which instance comes next is lib_pick.lua's; what waits is lib_survey.lua's. Every function takes
-- c, the claim context claim.lua builds (base, state_key, consumer, cfg, now, st, active_key,
-- affinity_key, warming_key, and the mutable warming_now).
-- Keys: M:state, M:active, M:affinity, M:warming, M:staged, M:staged_age, M:finished, M:hb:W,
--   M:inst:S:E and its lanes/fill/ready/free/touch sets, M:lane*/lanetok*/lanemeta* of a finished
--   instance.
-- Invariants: an instance is in M:staged (and M:staged_age) or in M:active, never both; it is
--   finished (its keys deleted) only once empty and served by no live worker; a preempted instance
--   keeps its lanes and items.
--@include lib.lua
--@include lib_workers.lua

local function inst_key(base, inst) return base .. ':inst:' .. inst end

-- Every write to an instance's hash in claim.lua's includes is followed by this: the staged fields
-- read earlier in the call (c.work, lib_survey.lua staged_fields) are then read again, so a claim
-- never weighs an instance by fields it has since changed.
local function inst_written(c, inst) c.work[inst] = nil end

-- detached: activated without becoming this worker's shape (interactive work, serve_hot).
local function activate(c, inst, reason, detached)
  local ik = inst_key(c.base, inst)
  redis.call('ZREM', c.base .. ':staged', inst)
  c.staged_top = nil  -- lib_survey.lua staged_top: M:staged changed
  redis.call('ZREM', c.base .. ':staged_age', inst)
  redis.call('HSET', ik, 'state', 'active', 'activated_ms', c.now, 'activated_by', reason)
  inst_written(c, inst)
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

-- An emptied instance's keys go, and its batch count joins the thrash alarm's history.
local function finish(c, inst)
  local base, ik = c.base, inst_key(c.base, inst)
  local lanes = redis.call('ZRANGE', ik .. ':lanes', '0', '-1')
  local h = hmget_named(ik, {'batches', 'taken'})
  local batches = num(h.batches)
  -- The batches its items could fill under the reference budget: the thrash alarm judges a
  -- shape against them, not against a fixed count alone.
  local could = math.max(1, math.ceil(num(h.taken) / c.cfg.budget_tokens))
  -- Its keys and its lanes' go in one DEL (in slices: unpack stops near 8,000 values), not one per lane.
  local gone = {ik, ik .. ':lanes', ik .. ':fill', ik .. ':ready', ik .. ':free', ik .. ':touch'}
  for _, lane in ipairs(lanes) do
    local l = inst .. ':' .. lane
    gone[#gone + 1] = base .. ':lane:' .. l
    gone[#gone + 1] = base .. ':lanetok:' .. l
    gone[#gone + 1] = base .. ':lanemeta:' .. l
  end
  for s = 1, #gone, 3000 do redis.call('DEL', unpack(gone, s, math.min(s + 2999, #gone))) end
  inst_written(c, inst)
  redis.call('ZREM', c.active_key, inst)
  redis.call('HDEL', c.affinity_key, c.consumer)
  redis.call('HINCRBY', c.state_key, 'shapes_finished', 1)
  -- Batches-per-shape history for the thrash alarm and its histogram (read by the workers'
  -- maintenance pass, then trimmed).
  redis.call('XADD', base .. ':finished', 'MAXLEN', '~', 10000, '*', 'inst', inst, 'batches', batches,
    'could', could, 'ms', c.now)
end

-- Aging preemption: this worker leaves its instance for an aged one; served by no other worker,
-- the instance steps back to staged (lanes and items intact), re-dated so it does not preempt
-- straight back.
local function preempt(c, inst)
  redis.call('HDEL', c.affinity_key, c.consumer)
  if (attachments(c)[inst] or 0) > 0 then return end
  local ik = inst_key(c.base, inst)
  redis.call('HSET', ik, 'state', 'staged', 'preempted_ms', c.now)
  inst_written(c, inst)
  redis.call('ZADD', c.base .. ':staged', num(redis.call('HGET', ik, 'tokens')), inst)
  c.staged_top = nil
  redis.call('ZADD', c.base .. ':staged_age', c.now, inst)
  redis.call('ZREM', c.active_key, inst)
  redis.call('HINCRBY', c.state_key, 'preemptions', 1)
end
