#!lua flags=allow-oom
-- allow-oom: at maxmemory a full Redis must still drain (this script frees or moves memory); only
-- submit.lua is refused, with QueueFull.
-- claim.lua: assemble one batch for one consumer under its contract and deliver it through
-- the consumer group: its entry goes straight into the consumer's pending list (XCLAIM FORCE)
-- (seeds 001, 002, 003).
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] cfg        cdr:{model}:cfg
-- KEYS[3] state      cdr:{model}:state
-- KEYS[4] batches    cdr:{model}:batches   (group "workers")
-- KEYS[5] reclaimed  cdr:{model}:reclaimed
-- ARGV[1] consumer, ARGV[2] max_batch_size, ARGV[3] max_batch_tokens, ARGV[4] max_input_len
--   (recorded only: input-length limits are the runtime's job, the broker never strands an item)
-- ARGV[5] token      1..64 of [A-Za-z0-9._-], fresh per call: the batch's items go to the list
--                    cdr:{model}:bat:<token>, which the caller reads in the same pipeline
-- Returns: {1, batch_id, sig, epoch, lane, padded_len, claimed_at_ms, flags, deliveries, n,
--   warming}; flags: 1 cleanup, 2 reclaimed, 4 force-drained lane; n items are in the token's
--   list, in lane order, as item records (conductor/keys.py); warming is the shape instance
--   "sig:epoch" being pre-warmed ('' if none): the pre-warm signal. Or {0, reason} when nothing
--   is dispatched (reason: gate, wait, idle, paused). Errors, with nothing written: 'ERR_ARG
--   <field>: ...'; 'NOPERM ...' when the caller's ACL refuses a command it may call (checked
--   first, lib.lua acl_refused); 'NOGROUP ...' when the batches stream lacks the group.
-- Cost: sizes come from the lanes' token lists; the first lane's items move to the batch list
--   inside Redis (SORT BY nosort LIMIT STORE keeps list order and reads only the range it
--   stores), a neighbouring lane's pass through Lua (LRANGE, RPUSH), so the script's work grows
--   with the items in the batch, not with the queue.
-- Invariants: a batch holds items of ONE shape instance of ONE model, from one lane or from
--   neighbouring lanes in length order, padded to the rep of the longest lane taken; what does not
--   fit stays at the head of its lane, in order; assembly order is reclaimed work, then lanes;
--   dispatch stays on the active instance until it is empty (or an aged shape preempts it:
--   aging and lane hygiene are swept at most every 250 ms, see swept()); each worker warms at
--   most one instance, its next; the work done grows with the batch (a bounded number of lanes
--   is looked at), never with the queue.
--@include lib.lua

local base, cfg_key, state_key, batches_key, reclaimed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local consumer = ARGV[1]
local max_items, max_tokens = tonumber(ARGV[2]), tonumber(ARGV[3])
local token = ARGV[5]
if (not consumer) or #consumer < 1 or #consumer > 200 then
  return redis.error_reply('ERR_ARG consumer: must be 1..200 bytes')
end
if not int_in(max_items, 1, 65536) then
  return redis.error_reply('ERR_ARG max_batch_size: must be an integer in 1..65536')
end
if not int_in(max_tokens, 1, 1073741824) then
  return redis.error_reply('ERR_ARG max_batch_tokens: must be an integer in 1..1073741824')
end
if (not token) or #token < 1 or #token > 64 or not string.match(token, '^[%w%._-]+$') then
  return redis.error_reply('ERR_ARG token: must be 1..64 characters from A-Z a-z 0-9 . _ -')
end
local batch_items_key = base .. ':bat:' .. token
if redis.call('EXISTS', batch_items_key) == 1 then
  return redis.error_reply('ERR_ARG token: ' .. token .. ' is in use by a pending batch')
end

-- Every cfg field this script (and the lib.lua helpers it calls) reads; tests/test_keys.py checks.
local CLAIM_CFG = {'mode', 'budget_tokens', 'budget_items', 'activate_batches', 'aging_ms', 'drain_batches',
  'hygiene_idle_ms', 'hygiene_items', 'lane_quiet_ms', 'prewarm_batches', 'quiet_ms', 'release_batches'}
local cfg = load_cfg(cfg_key, CLAIM_CFG)
-- Refused before the first write, nothing written: a command the caller's ACL denies ('NOPERM',
-- lib.lua acl_refused: every command this script may call, on each key or key pattern), and a
-- batches stream without the group (NOGROUP; XCLAIM would refuse it after the items moved).
do
  local I, L = base .. ':inst:0000000000000000:0', ':0000000000000000:0:0'
  local lk, tk, mk = base .. ':lane' .. L, base .. ':lanetok' .. L, base .. ':lanemeta' .. L
  local sk, sa, st, bk, rk = base .. ':staged', base .. ':staged_age', state_key, batch_items_key, reclaimed_key
  local il, fi, re, to, fr = I .. ':lanes', I .. ':fill', I .. ':ready', I .. ':touch', I .. ':free'
  local ac, af, wm = base .. ':active', base .. ':affinity', base .. ':warming'
  local refused = acl_refused(function(ok)
    return ok('HMGET', st) and ok('HSET', st) and ok('HINCRBY', st) and ok('HDEL', st) and ok('HGET', st)
      and ok('HMGET', base .. ':intake') and ok('HSET', base .. ':intake')
      and ok('ZADD', ac) and ok('ZREM', ac) and ok('ZRANGE', ac) and ok('HSET', af) and ok('HDEL', af)
      and ok('HGET', af) and ok('HGETALL', af) and ok('EXISTS', base .. ':hb:0') and ok('ZSCORE', sk)
      and ok('HGET', wm) and ok('HSET', wm) and ok('HDEL', wm)
      and ok('ZRANK', fi) and ok('ZRANGE', fi) and ok('LRANGE', lk)
      and ok('RPUSH', bk) and ok('XADD', batches_key) and ok('XCLAIM', batches_key) and ok('LINDEX', rk)
      and ok('LPOP', rk) and ok('LSET', rk) and ok('ZREM', sk) and ok('ZADD', sk) and ok('ZREVRANGE', sk)
      and ok('ZREM', sa) and ok('ZADD', sa) and ok('ZRANGE', sa) and ok('XADD', base .. ':finished')
      and ok('HSET', I) and ok('HGET', I) and ok('HMGET', I) and ok('ZREM', il) and ok('ZRANGE', il)
      and ok('ZREM', fi) and ok('ZADD', fi) and ok('ZREVRANGE', fi) and ok('ZREM', re) and ok('ZADD', re)
      and ok('ZRANGEBYSCORE', re) and ok('ZRANGE', re) and ok('ZREM', to) and ok('ZADD', to)
      and ok('ZRANGEBYSCORE', to) and ok('SADD', fr) and ok('LTRIM', lk) and ok('LRANGE', tk) and ok('LTRIM', tk)
      and ok('HMGET', mk) and ok('HSET', mk) and ok('HDEL', mk) and ok('HGET', mk) and ok('EXISTS', mk)
      and ok('TIME') and ok('XINFO', 'GROUPS', batches_key) and ok('SORT', lk, 'STORE', bk)
      and ok('DEL', I, il, fi, re, fr, to) and ok('DEL', lk, tk, mk)
  end)
  if refused then return refused end
  local groups = redis.pcall('XINFO', 'GROUPS', batches_key)
  local found = false
  if type(groups) == 'table' and not groups.err then
    for _, g in ipairs(groups) do
      if g[2] == 'workers' then found = true end
    end
  end
  if not found then
    return redis.error_reply('NOGROUP ' .. batches_key .. ' has no consumer group workers: nothing written')
  end
end
local now = now_ms()
local disk = cfg.mode == 'disk'

-- Pack under the contract: memory mode pads to the longest item rounded up to 8 and counts
-- padded tokens; disk mode counts actual tokens. The first item always goes, so an item
-- larger than the budget travels alone and the runtime answers it instead of it stranding.
local function fits(k, maxlen, sum, tok)
  if k == 0 then return true end
  if k >= max_items then return false end
  if disk then return sum + tok <= max_tokens end
  return (k + 1) * pad8(math.max(maxlen, tok)) <= max_tokens
end

-- The model's state, read once: every redis.call costs several microseconds here, and this
-- script runs once per batch. Only this script writes the counters below while it runs
-- (scripts are atomic), so deliver() writes them back from these values.
local st = redis.call('HMGET', state_key, 'gate', 'cleanup_since_ms', '', 'cleanup',
  'reclaimed_items', 'inflight_batches', 'inflight_items', 'batches', '', 'warming', 'sweep_ms', 'paused',
  'active', '')
-- The waiting counters and intake times live in the producer's hash (M:intake, which
-- deploy/redis/users.acl lets a producer write; M:state it may only read).
local intake_key = base .. ':intake'
local cleanup_since = st[2]
do
  local it = redis.call('HMGET', intake_key, 'tokens', 'last_intake_ms', 'items', 'sealed_ms', 'stored_tokens')
  st[2], st[3], st[9], st[14], st[15] = it[1], it[2], it[3], it[4], it[5]
end
-- Each worker warms its own next instance (M:warming), so in a fleet the shape a worker
-- prepared is the one it switches to, not one another worker took first.
local warming_key = base .. ':warming'
local warming_now = redis.call('HGET', warming_key, consumer) or ''
local cleanup = st[4] == '1'
-- Paused (see lib.lua paused()): nothing has been written yet, and nothing is.
if st[12] == '1' then return {0, 'paused'} end
-- New work ends cleanup mode (seed 001: "until empty or new work arrives"); submit.lua may not
-- write M:state, so the first claim after the intake ends it.
if cleanup and num(st[3]) > num(cleanup_since) then
  redis.call('HINCRBY', state_key, 'cleanup_ms', math.max(0, now - num(cleanup_since)))
  redis.call('HSET', state_key, 'cleanup', 0)
  cleanup = false
end

-- The batch's items are already in batch_items_key; this records the batch and hands it to the
-- consumer through the group.
-- waiting_tok and waiting_items: how much the model's waiting counters go down (the items left
-- a lane), 0 for reclaimed work; reclaimed: items taken from the reclaimed queue.
local function deliver(sig, ep, lane, maxlen, flags, dv, n, waiting_tok, waiting_items, reclaimed)
  local bid = redis.call('XADD', batches_key, '*', 'sig', sig, 'ep', ep, 'lane', lane,
    'n', n, 'plen', pad8(maxlen), 'w', consumer, 'ts', now, 'k', token, 'dv', dv, 'fl', flags)
  -- XCLAIM FORCE puts the entry straight into the consumer's pending list (delivery count 1,
  -- the consumer created if new) without reading it back; nothing reads the group with '>'.
  redis.call('XCLAIM', batches_key, 'workers', consumer, 0, bid, 'FORCE', 'JUSTID')
  redis.call('HSET', state_key, 'inflight_batches', num(st[6]) + 1, 'inflight_items', num(st[7]) + n,
    'batches', num(st[8]) + 1, 'reclaimed_items', num(st[5]) - reclaimed)
  if waiting_items > 0 then
    redis.call('HSET', intake_key, 'tokens', num(st[2]) - waiting_tok, 'items', num(st[9]) - waiting_items)
  end
  if flags % 2 == 1 then
    redis.call('HINCRBY', state_key, 'cleanup_batches', 1)
    redis.call('HINCRBY', state_key, 'cleanup_items', n)
  end
  return {1, bid, sig, ep, lane, pad8(maxlen), now, flags, dv, n, warming_now}
end

-- RPUSH of a whole list in slices: unpack() stops near 8,000 values, and an error there would
-- come after the batch's first items had moved (contracts allow 65,536 items).
local function push_all(key, list)
  for s = 1, #list, 2000 do
    redis.call('RPUSH', key, unpack(list, s, math.min(s + 1999, #list)))
  end
end

-- 1. Reclaimed work first (seed 001's assembly order). Reclaimed batches are already pure.
--    An entry is msgpack [sig, epoch, lane, deliveries, tokens, records] (lib_requeue.lua).
local head = num(st[5]) > 0 and redis.call('LINDEX', reclaimed_key, 0)
if head then
  local b = cmsgpack.unpack(head)
  local toks, recs = b[5], b[6]
  local k, maxlen, sum = 0, 0, 0
  while k < #toks and fits(k, maxlen, sum, toks[k + 1]) do
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
  push_all(batch_items_key, take)
  return deliver(b[1], b[2], b[3], maxlen, 2, b[4], k, 0, 0, k)
end

-- 2. Release gate: memory mode dispatches nothing until enough is waiting to make good first
--    batches; once open it stays open. Quiet intake opens it too, so a small job still runs.
local waiting, last_intake = num(st[2]), num(st[3])
-- The disk tier's store segments (conductor/tier.py) wait too: the gate counts them, and a model
-- whose lanes are empty while they wait is not idle (the feeder is loading them).
local stored = num(st[15])
-- Intake is quiet after quiet_ms of silence, or at once when a producer sealed its submission
-- after the last item arrived (seal.lua).
local sealed = num(st[14])
local function quiet_since(last) return now - last >= cfg.quiet_ms or sealed >= last end
local quiet = quiet_since(last_intake)
if st[1] ~= '1' then
  if disk or waiting + stored >= cfg.release_batches * cfg.budget_tokens or (quiet and waiting > 0) then
    redis.call('HSET', state_key, 'gate', 1, 'gate_opened_ms', now)
  elseif waiting + stored > 0 then
    return {0, 'gate'}
  else
    return {0, 'idle'}
  end
end

local function inst_key(inst) return base .. ':inst:' .. inst end

-- Several instances may be active at once, each worker on its own (M:affinity): a worker stays
-- on its instance until it is empty, then takes the one with the most waiting tokens per
-- worker serving it, so a deep shape is shared and a shallow one taken by one worker.
local active_key, affinity_key = base .. ':active', base .. ':affinity'

local function attach(inst)
  redis.call('HSET', affinity_key, consumer, inst)
  return inst
end

local function activate(inst, reason)
  local ik = inst_key(inst)
  redis.call('ZREM', base .. ':staged', inst)
  redis.call('ZREM', base .. ':staged_age', inst)
  redis.call('HSET', ik, 'state', 'active', 'activated_ms', now, 'activated_by', reason)
  redis.call('ZADD', active_key, now, inst)
  attach(inst)
  redis.call('HINCRBY', state_key, 'activations', 1)
  if warming_now == inst then
    redis.call('HDEL', warming_key, consumer)
    warming_now = ''
  end
  if st[10] == inst then redis.call('HDEL', state_key, 'warming') end
  return inst
end

local function aged()
  if cfg.aging_ms <= 0 then return nil end
  local old = redis.call('ZRANGE', base .. ':staged_age', 0, 0, 'WITHSCORES')
  if old[1] and now - tonumber(old[2]) >= cfg.aging_ms then return old[1] end
  return nil
end

local function finish(inst)
  local ik = inst_key(inst)
  local lanes = redis.call('ZRANGE', ik .. ':lanes', 0, -1)
  for _, lane in ipairs(lanes) do
    redis.call('DEL', base .. ':lane:' .. inst .. ':' .. lane, base .. ':lanetok:' .. inst .. ':' .. lane,
      base .. ':lanemeta:' .. inst .. ':' .. lane)
  end
  local h = redis.call('HMGET', ik, 'batches', 'taken')
  local batches = num(h[1])
  -- The batches its items could fill under the reference budget: the thrash alarm judges a
  -- shape against them, not against a fixed count alone.
  local could = math.max(1, math.ceil(num(h[2]) / cfg.budget_tokens))
  redis.call('DEL', ik, ik .. ':lanes', ik .. ':fill', ik .. ':ready', ik .. ':free', ik .. ':touch')
  redis.call('ZREM', active_key, inst)
  redis.call('HDEL', affinity_key, consumer)
  redis.call('HINCRBY', state_key, 'shapes_finished', 1)
  -- Batches-per-shape history for the thrash alarm and its histogram (read by the workers'
  -- maintenance pass, then trimmed).
  redis.call('XADD', base .. ':finished', 'MAXLEN', '~', 10000, '*', 'inst', inst, 'batches', batches,
    'could', could, 'ms', now)
end

-- A worker lives while its heartbeat key does (it expires with the worker's TTL).
local function alive(worker) return redis.call('EXISTS', base .. ':hb:' .. worker) == 1 end

-- Workers serving each active instance other than this one; a dead worker's entry (its
-- heartbeat key gone) is dropped. Bounded by the fleet; read only when a worker changes shape.
local function attachments()
  local aff = redis.call('HGETALL', affinity_key)
  local n = {}
  for i = 1, #aff, 2 do
    if aff[i] ~= consumer then
      if alive(aff[i]) then
        n[aff[i + 1]] = (n[aff[i + 1]] or 0) + 1
      else
        redis.call('HDEL', affinity_key, aff[i])
      end
    end
  end
  return n
end

-- The staged instance with the most tokens that no other worker is warming (each worker warms
-- one at a time, so at most a fleet's worth are skipped): (inst, tokens) or nil.
local function top_staged()
  local top = redis.call('ZREVRANGE', base .. ':staged', 0, 64, 'WITHSCORES')
  for i = 1, #top, 2 do
    local h = redis.call('HMGET', inst_key(top[i]), 'state', 'warming_for')
    -- a dead worker's reservation (its heartbeat key gone) lapses
    if h[1] ~= 'warming' or h[2] == consumer or not h[2] or not alive(h[2]) then
      return top[i], tonumber(top[i + 1])
    end
  end
  -- Every staged instance is another worker's next: take the largest rather than let it wait
  -- on a worker that may not come back for it soon (its prewarm is lost, nothing else).
  if top[1] then return top[1], tonumber(top[2]) end
  return nil, 0
end

-- The next shape for this worker: an aged one first (no shape waits for ever behind popular
-- ones); else the larger of the next staged instance (the warming one, which prepared for the
-- switch, or the one with the most tokens) once it holds activate_batches budgets, and an
-- active instance's tokens per worker serving it (sharing it); else, rather than idle, a
-- staged instance or a share holding one full batch; in cleanup any staged one; else any share.
local function pick_next(cleanup)
  local old = aged()
  if old then
    -- An aged shape is served whatever its fill: it drains at once (late arrivals stage anew).
    activate(old, 'aging')
    redis.call('HSET', inst_key(old), 'state', 'draining', 'draining_ms', now)
    return old
  end
  local n = attachments()
  local best, share = nil, 0
  for _, inst in ipairs(redis.call('ZRANGE', active_key, 0, -1)) do
    local t = num(redis.call('HGET', inst_key(inst), 'tokens'))
    if t > 0 and t / ((n[inst] or 0) + 1) > share then
      best, share = inst, t / ((n[inst] or 0) + 1)
    elseif t <= 0 and not n[inst] then
      finish(inst)  -- emptied while its last worker was away (it died or was preempted)
    end
  end
  local cand, ctok = nil, 0
  if warming_now ~= '' and redis.call('HGET', inst_key(warming_now), 'state') == 'warming' then
    cand = warming_now
    ctok = num(redis.call('ZSCORE', base .. ':staged', cand))
  else
    cand, ctok = top_staged()
  end
  local why = cand == warming_now and 'warmed' or 'threshold'
  local budget = cfg.budget_tokens
  if cand and ctok >= cfg.activate_batches * budget and ctok >= share then return activate(cand, why) end
  if best and share >= cfg.activate_batches * budget then return attach(best) end
  if cand and ctok >= budget and ctok >= share then return activate(cand, 'depth') end
  if best and share >= budget then return attach(best) end
  if cleanup and cand then return activate(cand, 'cleanup') end
  -- Rather than idle while another worker's instance holds items (that worker may be gated or
  -- stuck), help it: nothing waits on one worker alone.
  if best then return attach(best) end
  return nil
end

-- Pre-warm (seed 003): when the active instance runs low, mark the staged instance with the
-- most tokens (at least one full batch) as warming (one at a time) and tell the workers,
-- so graphs and caches are ready before the switch.
local function maybe_warm(inst_tokens)
  if inst_tokens >= cfg.prewarm_batches * cfg.budget_tokens then return end
  local cur = warming_now
  if cur ~= '' and redis.call('HGET', inst_key(cur), 'state') == 'warming' then return end
  local top, tokens = top_staged()
  -- One full batch is enough: a worker with nothing else activates such a shape (pick_next);
  -- in cleanup any shape is next, however small.
  if not top or (tokens < cfg.budget_tokens and not cleanup) then return end
  redis.call('HSET', inst_key(top), 'state', 'warming', 'warming_ms', now, 'warming_for', consumer)
  redis.call('HSET', warming_key, consumer, top)
  redis.call('HSET', state_key, 'warming', top)  -- the latest, for inspect
  warming_now = top
  redis.call('HINCRBY', state_key, 'warmings', 1)
end

-- Aging preemption: this worker leaves its instance for an aged one; served by no other worker,
-- the instance steps back to staged (lanes and items intact), re-dated so it does not preempt
-- straight back.
local function preempt(inst)
  redis.call('HDEL', affinity_key, consumer)
  if (attachments()[inst] or 0) > 0 then return end
  local ik = inst_key(inst)
  redis.call('HSET', ik, 'state', 'staged', 'preempted_ms', now)
  redis.call('ZADD', base .. ':staged', num(redis.call('HGET', ik, 'tokens')), inst)
  redis.call('ZADD', base .. ':staged_age', now, inst)
  redis.call('ZREM', active_key, inst)
  redis.call('HINCRBY', state_key, 'preemptions', 1)
end

local function retire_lane(inst, lane)
  local ik = inst_key(inst)
  redis.call('ZREM', ik .. ':lanes', lane)
  redis.call('ZREM', ik .. ':fill', lane)
  redis.call('ZREM', ik .. ':ready', lane)
  redis.call('ZREM', ik .. ':touch', lane)
  redis.call('DEL', base .. ':lane:' .. inst .. ':' .. lane, base .. ':lanetok:' .. inst .. ':' .. lane,
    base .. ':lanemeta:' .. inst .. ':' .. lane)
  redis.call('SADD', ik .. ':free', lane)
  redis.call('HINCRBY', state_key, 'lanes_retired', 1)
end

-- Plan one lane's part of a batch: read its token list (never more than the batch can still
-- take) and add items while they fit. acc carries the batch so far: k, maxlen, sum, full.
-- Memory mode pads a batch to the rep of the longest lane it takes from (the rep bounds every
-- item: lanes only grow), so each lane keeps one padded length: its graph is built once, and
-- ahead of time by the pre-warm signal, which names the lanes' padded reps.
local function plan_lane(inst, lane, acc)
  local mk = base .. ':lanemeta:' .. inst .. ':' .. lane
  local meta = redis.call('HMGET', mk, 'rep', 'last_ms', 'items', 'tokens')
  local room = max_items - acc.k
  if not disk then
    local plen = pad8(math.max(acc.maxlen, num(meta[1])))
    -- The first item always goes: one larger than the budget travels alone.
    room = math.min(room, math.max(math.floor(max_tokens / plen), acc.k == 0 and 1 or 0) - acc.k)
  end
  if room <= 0 then
    acc.full = true
    return nil
  end
  local want = math.min(room, num(meta[3]))
  if want <= 0 then return nil end
  local toks = redis.call('LRANGE', base .. ':lanetok:' .. inst .. ':' .. lane, 0, want - 1)
  local k, sum, mx = acc.k, 0, 0
  for i = 1, #toks do
    local tok = tonumber(toks[i])
    if disk and k > 0 and acc.sum + sum + tok > max_tokens then
      acc.full = true
      break
    end
    k = k + 1
    sum = sum + tok
    if tok > mx then mx = tok end
  end
  if k == acc.k then return nil end
  local seg = {lane = lane, k = k - acc.k, sum = sum, meta = meta, mk = mk}
  acc.k, acc.sum = k, acc.sum + sum
  acc.maxlen = math.max(acc.maxlen, disk and mx or num(meta[1]))
  if k >= max_items or (not disk and (k + 1) * pad8(acc.maxlen) > max_tokens) then acc.full = true end
  return seg
end

-- Plan a batch of one instance: from lane `first` when given (a ready lane, or a lane hygiene
-- drains), then, while the batch is not full, from the neighbouring non-empty lanes above it in
-- length order (the fill index scores each by its rep); without `first`, from the shortest lane
-- up. Padded to the longest item taken, like a cut of the instance's items sorted by length.
-- Reads only: the bound is the batch (each lane visited gives at least one item or closes it).
local function plan_batch(inst, first)
  local ik = inst_key(inst)
  local acc = {k = 0, maxlen = 0, sum = 0, full = false}
  local parts = {}
  local from = 0
  if first then
    local seg = plan_lane(inst, first, acc)
    if seg then parts[1] = seg end
    if acc.full then return parts, acc end
    from = redis.call('ZRANK', ik .. ':fill', first)
    if not from then return parts, acc end
    from = from + 1
  end
  while not acc.full do
    local lanes = redis.call('ZRANGE', ik .. ':fill', from, from + 15)
    if #lanes == 0 then break end
    for _, lane in ipairs(lanes) do
      if lane ~= first then
        local seg = plan_lane(inst, lane, acc)
        if seg then parts[#parts + 1] = seg end
        if acc.full then break end
      end
    end
    from = from + #lanes
  end
  return parts, acc
end

-- Move a planned batch from its lanes to the batch list and deliver it. info: the instance's
-- HMGET (inst_info) read by the caller in this call.
local function take_batch(inst, parts, acc, flags, info)
  local ik = inst_key(inst)
  for i, seg in ipairs(parts) do
    local lane = seg.lane
    local lk = base .. ':lane:' .. inst .. ':' .. lane
    if i == 1 then
      -- SORT BY nosort keeps list order and reads only the range it stores: the common batch,
      -- one lane's head, moves lane -> batch list without its bytes entering Lua.
      redis.call('SORT', lk, 'BY', 'nosort', 'LIMIT', 0, seg.k, 'STORE', batch_items_key)
    else
      push_all(batch_items_key, redis.call('LRANGE', lk, 0, seg.k - 1))
    end
    redis.call('LTRIM', lk, seg.k, -1)
    redis.call('LTRIM', base .. ':lanetok:' .. inst .. ':' .. lane, seg.k, -1)
    local meta, mk = seg.meta, seg.mk
    local rep = num(meta[1])
    local left, left_tok = num(meta[3]) - seg.k, num(meta[4]) - seg.sum
    if left <= 0 then
      redis.call('ZREM', ik .. ':fill', lane)
      redis.call('ZREM', ik .. ':ready', lane)
      redis.call('HSET', mk, 'items', left, 'tokens', left_tok)
      redis.call('HDEL', mk, 'since_ms')
      if now - num(meta[2]) >= cfg.lane_quiet_ms then retire_lane(inst, lane) end
    else
      redis.call('HSET', mk, 'items', left, 'tokens', left_tok, 'since_ms', now)
      if not lane_is_ready(cfg, left, left_tok, rep) then redis.call('ZREM', ik .. ':ready', lane) end
    end
  end
  local first = parts[1].lane
  local inst_tokens = num(info[3]) - acc.sum
  redis.call('HSET', ik, 'tokens', inst_tokens, 'items', num(info[6]) - acc.k, 'batches', num(info[7]) + 1, 'rr', first,
    'taken', num(info[8]) + acc.sum)
  if #parts > 1 then redis.call('HINCRBY', state_key, 'neighbour_fills', 1) end
  if info[1] ~= 'staged' then maybe_warm(inst_tokens) end
  local sig, ep = string.match(inst, '^(%x+):(%d+)$')
  return deliver(sig, tonumber(ep), tonumber(first), acc.maxlen, flags, 1, acc.k, acc.sum, acc.k, 0)
end

-- Plan and take in one step, whatever the batch's fill (ready lanes, lane hygiene, draining).
local function take_from(inst, first, flags, info)
  local parts, acc = plan_batch(inst, first)
  if #parts == 0 then return nil end
  return take_batch(inst, parts, acc, flags, info)
end

-- Cleanup mode (seed 001): nothing normal is ready, work remains and intake has gone quiet:
-- activation threshold 0 and batches down to one item, until empty or new work arrives.
local function enter_cleanup()
  if cleanup then return end
  cleanup = true
  redis.call('HSET', state_key, 'cleanup', 1, 'cleanup_since_ms', now)
  redis.call('HINCRBY', state_key, 'cleanup_entries', 1)
end

-- The fields of a shape instance every claim reads, once (take_batch uses them too).
local function inst_info(inst)
  return redis.call('HMGET', inst_key(inst), 'state', 'rr', 'tokens', 'last_intake_ms', 'idx', 'items', 'batches',
    'taken')
end

-- Aging and lane hygiene look for work that has waited seconds to minutes, so they are checked
-- at most every sweep period (a quarter of the shorter bound, at most 250 ms) rather than on
-- every claim; a sweep that finds something leaves the next claim to sweep again.
local sweep = now >= num(st[11])
local function swept()
  local period = math.min(250, cfg.hygiene_idle_ms / 4)
  if cfg.aging_ms > 0 then period = math.min(period, cfg.aging_ms / 4) end
  redis.call('HSET', state_key, 'sweep_ms', now + math.floor(period))
end

-- Before several instances could be active, the state hash named the one active instance.
if st[13] and st[13] ~= '' then
  redis.call('ZADD', active_key, now, st[13])
  redis.call('HDEL', state_key, 'active')
end
local active, info = redis.call('HGET', affinity_key, consumer), nil
if active then
  info = inst_info(active)
  if not info[1] then active = nil end
end
for _ = 1, 4 do
  if not active then
    active = pick_next(cleanup)
    if not active then
      if quiet and waiting > 0 and not cleanup then
        enter_cleanup()
        active = pick_next(true)
      end
      if not active then
        if waiting + stored > 0 then return {0, 'wait'} end
        if cleanup then
          local since = num(redis.call('HGET', state_key, 'cleanup_since_ms'))
          redis.call('HINCRBY', state_key, 'cleanup_ms', math.max(0, now - since))
          redis.call('HSET', state_key, 'cleanup', 0)
        end
        return {0, 'idle'}
      end
    end
    info = inst_info(active)
  end
  local ik = inst_key(active)
  local ist = info[1]
  if info[5] ~= index_version(cfg) then reindex(base, state_key, cfg, active) end
  local stale = nil
  if sweep then
    if ist == 'active' and aged() then
      preempt(active)
      active = pick_next(cleanup)
      ik = inst_key(active)
      info = inst_info(active)
      ist = info[1]
      if info[5] ~= index_version(cfg) then reindex(base, state_key, cfg, active) end
    end
    -- Lane hygiene (seed 003): a small lane nobody assigned to for a while, while the shape
    -- stays busy elsewhere, is force-drained so its items do not wait for ever.
    stale = redis.call('ZRANGEBYSCORE', ik .. ':touch', '-inf', now - cfg.hygiene_idle_ms, 'LIMIT', 0, 1)[1]
    if not stale then
      swept()
      sweep = false
    end
  end
  if stale then
    local left = num(redis.call('HGET', base .. ':lanemeta:' .. active .. ':' .. stale, 'items'))
    if left > 0 and left < cfg.hygiene_items then
      redis.call('HINCRBY', state_key, 'hygiene_drains', 1)
      local r = take_from(active, stale, (cleanup and 1 or 0) + 4, info)
      if r then return r end
    elseif left == 0 then
      redis.call('ZREM', ik .. ':touch', stale)
      if redis.call('EXISTS', base .. ':lanemeta:' .. active .. ':' .. stale) == 1 then
        retire_lane(active, stale)
      end
    else
      -- a big lane: it dispatches by readiness or drain; look at it again later
      redis.call('ZADD', ik .. ':touch', now, stale)
    end
  end
  -- Full batch: round-robin over ready lanes from the last lane served.
  local lane = redis.call('ZRANGEBYSCORE', ik .. ':ready', '(' .. num(info[2]), '+inf', 'LIMIT', 0, 1)[1]
  if not lane then lane = redis.call('ZRANGE', ik .. ':ready', 0, 0)[1] end
  if lane then
    local r = take_from(active, lane, cleanup and 1 or 0, info)
    if r then return r end
  end
  -- No lane holds a full batch alone: fill one from neighbouring lanes, shortest first.
  local parts, acc = plan_batch(active, nil)
  if acc.full then return take_batch(active, parts, acc, cleanup and 1 or 0, info) end
  if ist == 'active' then
    local low = num(info[3]) < cfg.drain_batches * cfg.budget_tokens
    local inst_quiet = quiet_since(num(info[4]))
    if low or inst_quiet or cleanup then
      redis.call('HSET', ik, 'state', 'draining', 'draining_ms', now)
      ist = 'draining'
    else
      return {0, 'wait'}
    end
  end
  -- Draining: what is left is less than a full batch: it goes as one, shortest lanes first.
  if #parts > 0 then return take_batch(active, parts, acc, cleanup and 1 or 0, info) end
  finish(active)
  active = nil
end
return {0, 'wait'}
