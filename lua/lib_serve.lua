-- lib_serve.lua: one pass of claim.lua over the instance a worker serves: aging preemption and
-- lane hygiene (swept at most every sweep period), then a full batch from a ready lane, then one
-- filled from neighbouring lanes (from the densest run of them while the shape's later items wait
-- in the disk tier's store and Redis has no room for them: lib_lanes.lua densest_lane), then the
-- drain decision; and interactive work, served before any
-- of that (serve_hot). Every function takes c, the claim context claim.lua builds (base, state_key,
-- cfg, now, cleanup, sweep). The fair share between tenants is lib_rebalance.lua's.
-- Keys: M:shape:S (read: stored_tokens), M:inst:S:E (read, state -> draining), its ready and touch
--   sets, M:lanemeta:S:E:L, M:hot, M:state sweep_ms and hygiene_drains; through lib_deliver.lua and
--   lib_pick.lua what they touch.
-- Invariants: dispatch stays on the instance until it is empty (or an aged shape preempts it);
--   a small lane nobody assigned to for hygiene_idle_ms while it is served is force-drained (flag 4),
--   so no item waits for ever behind busier lanes; a shape whose segments wait in the disk tier's
--   store is not at its end (awaits_store); the work grows with the batch, never with the queue.
--@include lib.lua
--@include lib_gate.lua
--@include lib_lifecycle.lua
--@include lib_pick.lua
--@include lib_deliver.lua

-- The fields of a shape instance every claim reads, once (take_batch uses them too).
local INST_FIELDS = {'state', 'rr', 'tokens', 'last_intake_ms', 'idx', 'items', 'batches', 'taken', 'tenant',
  'in_items', 'in_out', 'activated_ms'}
local function inst_info(c, inst) return hmget_named(inst_key(c.base, inst), INST_FIELDS) end

-- Whether later items of the instance's shape wait in the disk tier's store (its stored tokens).
local function stored_behind(c, inst)
  if c.stored <= 0 or c.cfg.resident_tokens <= 0 then return false end
  local shape = string.match(inst, '^([^:]+):')
  return num(redis.call('HGET', c.base .. ':shape:' .. shape, 'stored_tokens')) > 0
end

-- Whether segments of the instance's shape still wait in the disk tier's store (issue 37): then it
-- is not at its end, and the feeder loads them into it (conductor/tier/feeder.py takes a served
-- shape's segments first, up to the ceiling, and fills Redis with other work only up to the
-- ceiling less a reserve), so a lane of it is not force-drained into a padded batch (hygiene),
-- nor does it drain while the feeder has room for its next segment (room: at most 1/SEGMENT_PARTS
-- of the ceiling; serve). Bounded: without intake for hygiene_idle_ms since its last intake or its
-- activation, whichever is later (no feeder, a segment it cannot read), the shape is served as
-- before. From the activation too: a shape whose slice came in with the submit, seconds before it
-- is served, would otherwise drain its slice as a padded tail at once, and be taken up again from
-- its segments as a second piece.
local function awaits_store(c, inst, info, room)
  local ceiling = c.cfg.resident_tokens
  if c.stored <= 0 or ceiling <= 0
    or c.now - math.max(num(info.last_intake_ms), num(info.activated_ms)) >= c.cfg.hygiene_idle_ms
    or (room and num(c.intake.tokens) + math.floor(ceiling / RULES.SEGMENT_PARTS) > ceiling) then
    return false
  end
  return stored_behind(c, inst)
end

-- The instance's fill and ready indices follow the config they were derived under (lib.lua
-- index_version): re-derived here when that changed.
local function indexed(c, inst, info)
  if info.idx ~= index_version(c.cfg) then
    reindex(c.base, c.state_key, c.cfg, inst)
    inst_written(c, inst)
  end
end

-- Aging preemption (sweep only): an active instance gives way to an aged staged one, which is
-- then served (pick_next activates it). Returns the instance to serve and its fields.
local function preempt_aged(c, inst, info)
  if info.state ~= 'active' or not aged(c) then return inst, info end
  preempt(c, inst)
  inst = pick_next(c, c.cleanup)
  info = inst_info(c, inst)
  indexed(c, inst, info)
  return inst, info
end

-- Interactive work first (issue 26): the oldest interactive instance with items waiting gives
-- this worker a batch of whatever it holds, shortest lanes first, without becoming its shape (the
-- worker's affinity stays where it was, so it goes back to its own shape next); a staged one is
-- activated for it. An emptied one leaves M:hot (pick_next finishes it). Returns the reply, or nil
-- when no interactive item waits.
local function serve_hot(c)
  local hot_key = c.base .. ':hot'
  for _ = 1, 4 do
    local inst = redis.call('ZRANGE', hot_key, '0', '0')[1]
    if not inst then return nil end
    local info = inst_info(c, inst)
    if info.state and num(info.items) > 0 then
      if info.state == 'staged' or info.state == 'warming' then
        activate(c, inst, 'interactive', true)
        info.state = 'active'
      end
      indexed(c, inst, info)
      local parts, acc = plan_batch(c, inst, nil)
      if #parts > 0 then
        if num(info.items) - acc.k <= 0 then redis.call('ZREM', hot_key, inst) end
        c.hot = true
        return take_batch(c, inst, parts, acc, c.cleanup and 1 or 0, info)
      end
    end
    redis.call('ZREM', hot_key, inst)
  end
  return nil
end

-- Aging and lane hygiene look for work that has waited seconds to minutes, so they are checked
-- at most every sweep period (a quarter of the shorter bound, at most 250 ms) rather than on
-- every claim; a sweep that finds something leaves the next claim to sweep again.
local function swept(c)
  local period = math.min(250, c.cfg.hygiene_idle_ms / 4)
  if c.cfg.aging_ms > 0 then period = math.min(period, c.cfg.aging_ms / 4) end
  redis.call('HSET', c.state_key, 'sweep_ms', c.now + math.floor(period))
end

-- Lane hygiene (seed 003, sweep only): a small lane nobody assigned to for a while, while the
-- shape stays busy elsewhere, is force-drained so its items do not wait for ever; an empty one
-- is retired. Returns the reply when it drained a batch, or nil.
local function hygiene(c, inst, info)
  local base, cfg, now = c.base, c.cfg, c.now
  local ik = inst_key(base, inst)
  -- Idle while served: a lane that waited while its shape was staged (the disk tier's feeder
  -- loads the next shapes ahead, issue 37) is not behind busier lanes of it yet.
  local stale = now - num(info.activated_ms) >= cfg.hygiene_idle_ms and
    redis.call('ZRANGEBYSCORE', ik .. ':touch', '-inf', now - cfg.hygiene_idle_ms, 'LIMIT', 0, 1)[1]
  if not stale then
    swept(c)
    c.sweep = false
    return nil
  end
  local left = num(redis.call('HGET', base .. ':lanemeta:' .. inst .. ':' .. stale, 'items'))
  if left > 0 and left < cfg.hygiene_items and not awaits_store(c, inst, info, false) then
    redis.call('HINCRBY', c.state_key, 'hygiene_drains', 1)
    return take_from(c, inst, stale, (c.cleanup and 1 or 0) + 4, info)
  elseif left == 0 then
    redis.call('ZREM', ik .. ':touch', stale)
    if redis.call('EXISTS', base .. ':lanemeta:' .. inst .. ':' .. stale) == 1 then
      retire_lane(c, inst, stale)
    end
  else
    -- a big lane: it dispatches by readiness or drain; look at it again later
    redis.call('ZADD', ik .. ':touch', now, stale)
  end
  return nil
end

-- A batch of the instance: a full one from a ready lane (round-robin from the last lane served),
-- else one filled from neighbouring lanes, shortest first; an active instance with no full
-- batch drains once low or quiet (or in cleanup) unless its shape awaits the store, and a draining
-- one sends what it has.
-- Returns the reply, or nil when the instance is empty (the caller finishes it).
local function serve(c, inst, info)
  local ik = inst_key(c.base, inst)
  local flags = c.cleanup and 1 or 0
  -- rr is a lane id as take_batch wrote it ('%d' digits, -1 at first): used as the text it is, where
  -- num() and the concatenation would convert it twice and format it back ('%.14g'); numbers as text
  -- (a Lua number argument costs Redis a '%.17g' format: the Redis cost notes' eighth pass)
  local lane = redis.call('ZRANGEBYSCORE', ik .. ':ready', '(' .. (info.rr or '0'), '+inf', 'LIMIT', '0', '1')[1]
  if not lane then lane = redis.call('ZRANGE', ik .. ':ready', '0', '0')[1] end
  if lane then
    local r = take_from(c, inst, lane, flags, info)
    if r then return r end
  end
  -- A batch filled across lanes pads to the longest lane taken: while the shape's next segment
  -- can come, its items are waited for, which make lanes ready (full from one lane) as they do
  -- when the whole shape is in Redis.
  if info.state == 'active' and awaits_store(c, inst, info, true) then return {0, 'wait'} end
  -- No room for the next segment: a batch across lanes now, from the densest run of them.
  local first = info.state == 'active' and stored_behind(c, inst) and densest_lane(c, inst) or nil
  local parts, acc = plan_batch(c, inst, first)
  if first and not acc.full then parts, acc = plan_batch(c, inst, nil) end
  if acc.full then return take_batch(c, inst, parts, acc, flags, info) end
  if info.state == 'active' then
    local low = num(info.tokens) < c.cfg.drain_batches * c.cfg.budget_tokens
    if low or quiet_since(c, num(info.last_intake_ms)) or c.cleanup then
      redis.call('HSET', ik, 'state', 'draining', 'draining_ms', c.now)
      inst_written(c, inst)
    else
      return {0, 'wait'}
    end
  end
  -- Draining: what is left is less than a full batch: it goes as one, shortest lanes first.
  if #parts > 0 then return take_batch(c, inst, parts, acc, flags, info) end
  return nil
end
