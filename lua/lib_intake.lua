-- lib_intake.lua: where submit.lua puts each item (seed 002): the shape instance that takes new
-- items (a draining or finished one never does: the signature's next epoch, staged, does), the
-- lane (rolling lanes, opened when joining the best neighbour would pad past a threshold that
-- rises as the lane budget fills; retired lane ids reused first; the depth rule), and the lanes'
-- writes, once per call and lane. s is the submit context submit.lua builds: base, cfg, now,
-- depth (per signature, what the call brings), ctxs (per signature, its shape_ctx).
-- Keys: M:shape:S (epoch), M:inst:S:E and its lanes/free/touch/fill/ready sets, M:staged,
--   M:staged_age, M:lane:S:E:L, M:lanetok:S:E:L, M:lanemeta:S:E:L; M:bell (ring_doorbell).
-- Invariants: a lane list and its token list always have the same length, in the same order;
--   lanes only grow (a lane's rep never shrinks) and are never merged.
--@include lib.lua

-- The job's class (job_class.lua), read once per call: {tenant, prio, deadline (ms, 0: none), own}
-- (own: the job is its own tenant in batch priority, whose items use the plain signature).
local function job_class(base, job)
  local h = redis.call('HMGET', base .. ':in:' .. job, 'tenant', 'prio', 'deadline_ms')
  local tenant, prio = h[1] or job, h[2] or 'batch'
  return {tenant = tenant, prio = prio, deadline = tonumber(h[3]) or 0, own = tenant == job and prio == 'batch'}
end

-- The signature whose instances take the items of a job of this class.
local function qualified(class, sig)
  if class.own then return sig end
  return string.sub(redis.sha1hex(sig .. '|' .. class.tenant .. '|' .. class.prio), 1, 16)
end

-- The signature's instance that takes this call's items, read (and staged anew when needed)
-- once per call: {inst, ik, st (its state), reps and ids (its lanes by rep), touched, order,
-- tokens, items, max_lanes}.
local function shape_ctx(s, sig, depth_sig)
  local base, cfg, now = s.base, s.cfg, s.now
  local ctx = s.ctxs[sig]
  if ctx then return ctx end
  local shape_key = base .. ':shape:' .. sig
  local ep = tonumber(redis.call('HGET', shape_key, 'epoch'))
  local st = nil
  if ep then st = redis.call('HGET', base .. ':inst:' .. sig .. ':' .. ep, 'state') end
  if (not st) or st == 'draining' or st == 'finished' then
    ep = (ep or 0) + 1
    st = 'staged'
    local ik = base .. ':inst:' .. sig .. ':' .. ep
    redis.call('HSET', shape_key, 'epoch', ep)
    local class = s.class
    redis.call('HSET', ik, 'state', 'staged', 'sig', sig, 'epoch', ep, 'created_ms', now,
      'tokens', 0, 'items', 0, 'batches', 0, 'lane_seq', 0, 'rr', -1, 'idx', index_version(cfg),
      'tenant', class.tenant, 'prio', class.prio, 'deadline', class.deadline)
    redis.call('ZADD', base .. ':staged_age', 'NX', now, sig .. ':' .. ep)
  elseif s.class.deadline > 0 then
    -- an instance's deadline is its jobs' earliest
    local ik = base .. ':inst:' .. sig .. ':' .. ep
    local d = tonumber(redis.call('HGET', ik, 'deadline') or '0') or 0
    if d == 0 or s.class.deadline < d then redis.call('HSET', ik, 'deadline', s.class.deadline) end
  end
  local inst = sig .. ':' .. ep
  local ik = base .. ':inst:' .. inst
  local raw = redis.call('ZRANGE', ik .. ':lanes', 0, -1, 'WITHSCORES')
  local reps, ids = {}, {}
  for j = 1, #raw, 2 do
    ids[#ids + 1] = raw[j]
    reps[#reps + 1] = tonumber(raw[j + 1])
  end
  -- Depth rule: no more lanes than lane_depth per full batch (reference budget) the instance
  -- will hold once this call is in: a shallow shape gets few wide lanes, whose items a claim
  -- still packs into full batches with their neighbours; a deep one narrow lanes.
  local max_lanes = cfg.lane_max
  if cfg.lane_depth > 0 then
    local have = redis.call('HMGET', ik, 'tokens', 'items')
    local d = s.depth[depth_sig or sig]  -- what the call brings, counted under its items' own signature
    local full = math.max((num(have[1]) + d.tokens) / cfg.budget_tokens, (num(have[2]) + d.items) / cfg.budget_items)
    max_lanes = math.min(max_lanes, math.max(1, math.ceil(cfg.lane_depth * full)))
  end
  ctx = {inst = inst, ik = ik, st = st, reps = reps, ids = ids, touched = {}, order = {}, opened = {},
    tokens = 0, items = 0, out = 0, max_lanes = max_lanes}
  s.ctxs[sig] = ctx
  return ctx
end

-- Spend structure before spending waste: open a lane when joining the best neighbour would
-- pad more than a threshold that rises as the lane budget fills. pad8 (lib.lua) written out as x + (-x) % 8
-- and the midpoint as (s - s % 2) / 2: VM arithmetic (% is floored: exact for whole numbers), not math's C calls.
local function choose_lane(cfg, ctx, tok)
  local reps, ids = ctx.reps, ctx.ids
  local nl = #reps
  local lo, hi = 1, nl + 1
  while lo < hi do
    local s = lo + hi; local mid = (s - s % 2) / 2
    if reps[mid] >= tok then hi = mid else lo = mid + 1 end
  end
  local up = lo
  local p = tok + (-tok) % 8
  local best, cost = nil, nil
  if up <= nl then local r = reps[up]; best = up; cost = r + (-r) % 8 - p end
  if up > 1 then
    local r = reps[up - 1]
    local c = p - (r + (-r) % 8)
    if (not best) or c < cost then best = up - 1; cost = c end
  end
  local open = false
  if not best then
    open = true
  elseif nl < ctx.max_lanes and cost > cfg.lane_floor then
    if cost > cfg.lane_cap then
      open = true
    else
      local used = nl / cfg.lane_max
      local thr = cfg.lane_thr_min + (cfg.lane_thr_max - cfg.lane_thr_min) * used * used
      if cost / math.max(p, pad8(reps[best])) > thr then open = true end
    end
  end
  if open then
    -- A retired lane's id first; the free set, once empty, is not asked again this call (nothing adds
    -- to it here). New ids count from one read of lane_seq, written back once by grow_lanes.
    local id = (not ctx.free_empty) and redis.call('SPOP', ctx.ik .. ':free')
    if not id then
      ctx.free_empty = true
      if not ctx.seq then ctx.seq, ctx.seq_new = num(redis.call('HGET', ctx.ik, 'lane_seq')), 0 end
      id = string.format('%d', ctx.seq + ctx.seq_new)
      ctx.seq_new = ctx.seq_new + 1
    end
    table.insert(reps, up, tok)
    table.insert(ids, up, id)
    ctx.opened[id] = true
    return id, tok
  end
  if reps[best] < tok then reps[best] = tok end
  return ids[best], reps[best]
end

-- A lane hash that does not exist, as HMGET would read it (no field)
local NO_META = {}
-- Lanes grow and counters move once per call and lane, not once per item.
-- s: the submit context (base, cfg, now); ctx: shape_ctx's, with the call's items placed.
local function grow_lanes(s, ctx)
  local base, cfg, now = s.base, s.cfg, s.now
  local ik = ctx.ik
  -- Per lane: its two lists and one read and one write of its hash. The sorted sets of the
  -- instance take every touched lane in one ZADD each: a call of 1,000 items touches hundreds
  -- of lanes, and every redis.call costs a few microseconds.
  -- Whole numbers go to Redis as strings made with '%d': Redis formats a Lua number with '%.17g'
  -- (about 2.3k instructions; five or six a lane), '%d' the same digits for a third; `now` once a
  -- call. nt counts zt's and zf's entries (the length operator is a search in Lua 5.1).
  local fmt = string.format
  local now_s = fmt('%d', now)
  local zl, zt, zf, zr, nt = {}, {}, {}, {}, 0
  for _, lane in ipairs(ctx.order) do
    local t = ctx.touched[lane]
    local mk = base .. ':lanemeta:' .. ctx.inst .. ':' .. lane
    redis.call('RPUSH', base .. ':lane:' .. ctx.inst .. ':' .. lane, unpack(t.recs))
    redis.call('RPUSH', base .. ':lanetok:' .. ctx.inst .. ':' .. lane, unpack(t.toks))
    -- A lane opened by this call has no hash yet: a retired lane's went with it (lib_lanes.lua
    -- retire_lane, lib_repair.lua), and a lane_seq id was never used.
    local m = ctx.opened[lane] and NO_META or redis.call('HMGET', mk, 'items', 'tokens', 'rep', 'since_ms')
    local items, tokens = num(m[1]) + t.items, num(m[2]) + t.tokens
    local rep = math.max(t.rep, num(m[3]))
    local rep_s = fmt('%d', rep)
    redis.call('HSET', mk, 'items', fmt('%d', items), 'tokens', fmt('%d', tokens), 'rep', rep_s, 'last_ms', now_s,
      'since_ms', m[4] or now_s)
    if rep ~= tonumber(m[3]) then zl[#zl + 1] = rep_s; zl[#zl + 1] = lane end
    nt = nt + 2
    zt[nt - 1], zt[nt] = now_s, lane
    zf[nt - 1], zf[nt] = rep_s, lane
    if lane_is_ready(cfg, items, tokens, rep) then zr[#zr + 1] = lane; zr[#zr + 1] = lane end
  end
  if #zl > 0 then redis.call('ZADD', ik .. ':lanes', unpack(zl)) end
  if #zt > 0 then
    redis.call('ZADD', ik .. ':touch', unpack(zt))
    redis.call('ZADD', ik .. ':fill', unpack(zf))
  end
  if #zr > 0 then redis.call('ZADD', ik .. ':ready', unpack(zr)) end
  if ctx.seq_new and ctx.seq_new > 0 then redis.call('HINCRBY', ik, 'lane_seq', fmt('%d', ctx.seq_new)) end
  if ctx.items > 0 then
    local tokens = redis.call('HINCRBY', ik, 'tokens', fmt('%d', ctx.tokens))
    redis.call('HINCRBY', ik, 'items', fmt('%d', ctx.items))
    -- Every item placed and the sum of their output limits, never decremented: their ratio, the
    -- instance's mean output limit, prices its waiting items for the fleet's choice of work
    -- (lib_survey.lua inst_work) without a per-item read at claim time.
    redis.call('HINCRBY', ik, 'in_items', fmt('%d', ctx.items))
    redis.call('HINCRBY', ik, 'in_out', fmt('%d', ctx.out))
    redis.call('HSET', ik, 'last_intake_ms', now_s)
    if ctx.st == 'staged' or ctx.st == 'warming' then
      redis.call('ZADD', base .. ':staged', fmt('%d', tokens), ctx.inst)
    end
    -- interactive work: claimed before any other at the next claim (lib_serve.lua serve_hot)
    if s.class.prio == 'interactive' then redis.call('ZADD', base .. ':hot', 'NX', now_s, ctx.inst) end
  end
end

-- Doorbell: one entry per full batch the call brought (at least one, at most BELL_CAP), each
-- waking one idle worker blocked on BLPOP; trimmed to BELL_CAP, so unread rings cannot pile up.
local function ring_doorbell(base, cfg, new_tokens, new_items)
  local BELL_CAP, BELL_LAST = 16, '15'  -- LTRIM's last index, BELL_CAP - 1, as Redis reads it
  local rings = math.min(BELL_CAP, math.max(1, math.ceil(math.max(new_tokens / cfg.budget_tokens,
    new_items / cfg.budget_items))))
  local bells = {}
  for r = 1, rings do bells[r] = '1' end
  redis.call('LPUSH', base .. ':bell', unpack(bells))
  redis.call('LTRIM', base .. ':bell', '0', BELL_LAST)
end
