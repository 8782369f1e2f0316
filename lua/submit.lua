#!lua
-- The shebang (no flags) makes Redis 7 refuse this script at maxmemory before it runs and, on a
-- cluster node, refuse any key outside the slot of the model's hash tag.
-- submit.lua: append items to their shape's rolling lanes (seed 002), atomically.
--
-- KEYS[1] base    cdr:{model}            (per-shape, per-lane and per-job keys derive from it)
-- KEYS[2] cfg     cdr:{model}:cfg
-- KEYS[3] state   cdr:{model}:state   (read only: paused)
-- Writes only the producer's keys (deploy/redis/users.acl gives a producer nothing else):
--   M:intake (waiting tokens and items, submitted, last intake), M:in:J and M:in:J:sums (the
--   job's declared and submitted counts, and the id registry), the shape, instance and lane keys.
-- ARGV[1] n       number of items that follow (1..5000)
-- ARGV[2] job     the job every item of the call belongs to
-- ARGV[3..]       3 fields per item: sig (16 hex), record, prefix (JSON list of at most 256
--                 strings, or '' when another item of this call carries it or the signature's
--                 prefix is stored already; a new signature's must come in the call). The record is the item
--                 as workers read it (conductor/keys.py): the JSON array
--                 [id, job, input_tokens, max_tokens, prompt, payload], first byte '[', in
--                 standard JSON: a form only cjson takes (NaN, hex, leading zeros) passes this
--                 check, and the worker answers that item with a bad_record error.
-- Returns: one integer per item: the lane id it joined, or -1 when this job already has an
--   item with this id (an interrupted submit re-run neither loses nor duplicates). An id that
--   waits in a store segment (registry mark 's<seq>:<sum>', register_segment.lua) joins a lane
--   once, counted then as waiting instead of stored (the disk tier's feeder loads segments so).
--   Errors, with nothing written: 'ERR_ARG <field>: ...' for a malformed argument,
--   'FULL ...' when the model's waiting-token ceiling (cfg max_waiting_tokens) would be passed,
--   'NOPERM ...' when the caller's ACL refuses a command this call may run (lib.lua acl_refused).
--   'CONFLICT <n> ...' when n ids of the call are ids the job already has with other content
--   (another shape or record: the first 16 hex digits of SHA-1(sig .. record) kept per id in
--   M:in:J:sums differ).
-- A re-sent id with the same content is a duplicate (-1); with other content it is another
--   job's item under a reused job name, whose old results a reader would take for its own.
-- Writes each record as sent to its lane list, and its input tokens to the lane's token list at
--   the same position. The producer builds the record: building it here cost over a quarter
--   of the server time per item (bench/RESULTS.md, bench/submit_profile.py), and the decode
--   that checks it is needed anyway.
-- Invariants: every argument is checked before the first write (all or nothing per call);
--   a lane list and its token list always have the same length, in the same order;
--   lanes only grow and are never merged; a draining or finished shape instance never takes
--   a new item: the signature's next epoch (staged) does.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua

local base, cfg_key, state_key = KEYS[1], KEYS[2], KEYS[3]
local intake_key = base .. ':intake'
local n = tonumber(ARGV[1])
if not int_in(n, 1, 5000) then
  return redis.error_reply('ERR_ARG n: item count must be an integer in 1..5000')
end
if #ARGV ~= 2 + 3 * n then
  return redis.error_reply('ERR_ARG argv: expected ' .. (2 + 3 * n) .. ' arguments, got ' .. #ARGV)
end
local job = ARGV[2]
if #job < 1 or #job > 128 or not string.match(job, '^[%w%._/@+=-]+$') then
  return redis.error_reply('ERR_ARG job: invalid job name')
end

-- Mirrors conductor/formats.py: the edge refuses first; the script refuses what other clients send.
local MAX_TOKENS = 16777216
local MAX_OUTPUT = 1048576
local MAX_RECORD = 8388608 + 8192  -- a body of 8 MiB, and an id and job escaped at worst
local call_tokens = 0
-- Per item, from the decode that checks its record: its id and input tokens.
local ids, toks = {}, {}
-- A call's items nearly always share a few shapes: each distinct one is pattern-checked once.
local sigs_ok = {}
-- Per signature, the first prefix the call carries (stored once below) or nil.
local prefixes = {}
-- Per signature, what this call brings: the depth rule counts it before the first item is placed,
-- so a backlog sent in a few calls gets the lanes its whole depth deserves.
local call_depth = {}
local cjson_decode, byte = cjson.decode, string.byte
for i = 0, n - 1 do
  local o = 3 + 3 * i
  local sig, rec, prefix = ARGV[o], ARGV[o + 1], ARGV[o + 2]
  if not sigs_ok[sig] then
    if #sig ~= 16 or not string.match(sig, '^[0-9a-f]+$') then
      return redis.error_reply('ERR_ARG sig: must be 16 lowercase hex digits at item ' .. i)
    end
    sigs_ok[sig] = true
  end
  if #rec > MAX_RECORD or #prefix > MAX_RECORD then
    return redis.error_reply('ERR_ARG record: larger than ' .. MAX_RECORD .. ' bytes at item ' .. i)
  end
  -- Workers decode the record as it is stored: a malformed one would fail every delivery until
  -- dead-lettered.
  local ok, d = pcall(cjson_decode, rec)
  if not ok or type(d) ~= 'table' or byte(rec, 1) ~= 91 or #d < 5 or #d > 6 then
    return redis.error_reply('ERR_ARG record: must be a JSON array [id, job, input_tokens, ' ..
      'max_tokens, prompt, payload] at item ' .. i)
  end
  local id, tok = d[1], d[3]
  if type(id) ~= 'string' or #id < 1 or #id > 512 then
    return redis.error_reply('ERR_ARG id: must be a string of 1..512 bytes at item ' .. i)
  end
  if d[2] ~= job then
    return redis.error_reply('ERR_ARG job: the record names another job than the call at item ' .. i)
  end
  if type(tok) ~= 'number' or not int_in(tok, 1, MAX_TOKENS) then
    return redis.error_reply('ERR_ARG input_tokens: must be an integer in 1..' .. MAX_TOKENS .. ' at item ' .. i)
  end
  if type(d[4]) ~= 'number' or not int_in(d[4], 1, MAX_OUTPUT) then
    return redis.error_reply('ERR_ARG max_tokens: must be an integer in 1..' .. MAX_OUTPUT .. ' at item ' .. i)
  end
  if type(d[5]) ~= 'string' then
    return redis.error_reply('ERR_ARG prompt: must be a string at item ' .. i)
  end
  if prefix ~= '' then
    -- As conductor/formats.py: a list of at most 256 strings (workers pass it to the engine as is).
    ok, d = pcall(cjson_decode, prefix)
    local good = ok and type(d) == 'table' and string.find(prefix, '^%s*%[') ~= nil
    if good then
      local k = 0
      for _, v in pairs(d) do
        k = k + 1
        if type(v) ~= 'string' then good = false break end
      end
      good = good and k == #d and k <= 256
    end
    if not good then
      return redis.error_reply('ERR_ARG prefix: must be a JSON list of at most 256 strings at item ' .. i)
    end
    if not prefixes[sig] then prefixes[sig] = prefix end
  end
  ids[i + 1], toks[i + 1] = id, tok
  call_tokens = call_tokens + tok
  local d = call_depth[sig]
  if not d then
    d = {tokens = 0, items = 0}
    call_depth[sig] = d
  end
  d.tokens = d.tokens + tok
  d.items = d.items + 1
end
-- A signature without a stored prefix (a new one) needs the call to carry it: workers read the
-- shape's prefix from there.
for sig in pairs(sigs_ok) do
  if not prefixes[sig] and redis.call('HEXISTS', base .. ':shape:' .. sig, 'prefix') == 0 then
    return redis.error_reply('ERR_ARG prefix: signature ' .. sig .. ' has no prefix yet: the call must carry ' ..
      'its prefix (a JSON list of strings) on one of its items')
  end
end

local refused = paused(state_key)
if refused then return refused end
local cfg = load_cfg(cfg_key)
if cfg.max_waiting_tokens > 0 then
  local waiting = num(redis.call('HGET', intake_key, 'tokens'))
  if waiting + call_tokens > cfg.max_waiting_tokens then
    return redis.error_reply('FULL model queue holds ' .. waiting .. ' waiting tokens; ' .. call_tokens ..
      ' more would pass the ceiling of ' .. cfg.max_waiting_tokens)
  end
end

-- Every command this call may run, on each key or key pattern, before the first write (lib.lua
-- acl_refused): a refusal halfway would leave the writes before it.
do
  local I, L, jk = base .. ':inst:0000000000000000:0', ':0000000000000000:0:0', base .. ':in:' .. job
  local sh, it = base .. ':shape:0000000000000000', intake_key
  local refused = acl_refused(function(ok)
    return ok('HGET', state_key) and ok('HGET', it) and ok('HINCRBY', it) and ok('HSET', it) and ok('HMGET', jk .. ':sums')
      and ok('HSET', jk .. ':sums') and ok('HINCRBY', jk) and ok('HGET', sh) and ok('HSET', sh) and ok('HSETNX', sh)
      and ok('HGET', I) and ok('HMGET', I) and ok('HSET', I) and ok('HINCRBY', I) and ok('ZADD', base .. ':staged_age')
      and ok('ZADD', base .. ':staged') and ok('ZRANGE', I .. ':lanes') and ok('ZADD', I .. ':lanes')
      and ok('SPOP', I .. ':free') and ok('ZADD', I .. ':touch') and ok('ZADD', I .. ':fill')
      and ok('ZADD', I .. ':ready') and ok('RPUSH', base .. ':lane' .. L) and ok('RPUSH', base .. ':lanetok' .. L)
      and ok('HMGET', base .. ':lanemeta' .. L) and ok('HSET', base .. ':lanemeta' .. L) and ok('TIME')
  end)
  if refused then return refused end
end
local now = now_ms()
local ctxs = {}

local function shape_ctx(sig)
  local ctx = ctxs[sig]
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
    redis.call('HSET', ik, 'state', 'staged', 'sig', sig, 'epoch', ep, 'created_ms', now,
      'tokens', 0, 'items', 0, 'batches', 0, 'lane_seq', 0, 'rr', -1, 'idx', index_version(cfg))
    redis.call('ZADD', base .. ':staged_age', 'NX', now, sig .. ':' .. ep)
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
    local d = call_depth[sig]
    local full = math.max((num(have[1]) + d.tokens) / cfg.budget_tokens, (num(have[2]) + d.items) / cfg.budget_items)
    max_lanes = math.min(max_lanes, math.max(1, math.ceil(cfg.lane_depth * full)))
  end
  ctx = {inst = inst, ik = ik, st = st, reps = reps, ids = ids, touched = {}, order = {},
    tokens = 0, items = 0, max_lanes = max_lanes}
  ctxs[sig] = ctx
  return ctx
end

-- Spend structure before spending waste: open a lane when joining the best neighbour would
-- pad more than a threshold that rises as the lane budget fills.
local function choose_lane(ctx, tok)
  local reps, ids = ctx.reps, ctx.ids
  local nl = #reps
  local lo, hi = 1, nl + 1
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if reps[mid] >= tok then hi = mid else lo = mid + 1 end
  end
  local up = lo
  local p = pad8(tok)
  local best, cost = nil, nil
  if up <= nl then best = up; cost = pad8(reps[up]) - p end
  if up > 1 then
    local c = p - pad8(reps[up - 1])
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
    local id = redis.call('SPOP', ctx.ik .. ':free')
    if not id then id = redis.call('HINCRBY', ctx.ik, 'lane_seq', 1) - 1 end
    id = tostring(id)
    table.insert(reps, up, tok)
    table.insert(ids, up, id)
    return id, tok
  end
  if reps[best] < tok then reps[best] = tok end
  return ids[best], reps[best]
end

-- Which ids the job already has, and their content sums: the sums hash is the job's id registry
-- (one read for the call, one write of the new ones: a call of 1,000 items would otherwise run
-- 1,000 HSETNX).
local job_sums = base .. ':in:' .. job .. ':sums'
local known = redis.call('HMGET', job_sums, unpack(ids))
local first, fresh_sums = {}, {}
local conflicts = 0
-- Ids registered by register_segment.lua ('s<seq>:<sum>') wait in a store segment: this call
-- places them (the feeder loading the segment, or a producer sending the item again), once: the
-- registry then holds the plain sum, and the stored counters move to the waiting ones.
local from_store = {}
for i = 1, n do
  local o = 3 * i
  local sum = string.sub(redis.sha1hex(ARGV[o] .. ARGV[o + 1]), 1, 16)
  local id = ids[i]
  local had = known[i]
  if had and byte(had, 1) == 115 and string.sub(had, -16) == sum then
    from_store[i], known[i] = true, false  -- another content under the id is a conflict below
  end
  if known[i] then
    -- '-': an id stored before sums were kept (migrations/0003): it cannot be judged, so it
    -- stays a duplicate
    if known[i] ~= '-' and known[i] ~= sum then conflicts = conflicts + 1 end
  elseif first[id] then
    if first[id] ~= sum then conflicts = conflicts + 1 end
  else
    first[id] = sum
    fresh_sums[#fresh_sums + 1] = id
    fresh_sums[#fresh_sums + 1] = sum
  end
end
if conflicts > 0 then
  return redis.error_reply('CONFLICT ' .. conflicts .. ' ids of this call are ids job ' .. job ..
    ' already has with other content')
end
local out, seen = {}, {}
local new_items, new_tokens = 0, 0
local fed_items, fed_tokens = 0, 0
for i = 0, n - 1 do
  local o = 3 + 3 * i
  local id, tok = ids[i + 1], toks[i + 1]
  if known[i + 1] or seen[id] then
    out[#out + 1] = -1
  else
    seen[id] = true
    local sig, prefix = ARGV[o], ARGV[o + 2]
    local ctx = shape_ctx(sig)
    if prefixes[sig] then redis.call('HSETNX', base .. ':shape:' .. sig, 'prefix', prefixes[sig]); prefixes[sig] = false end
    local lane, rep = choose_lane(ctx, tok)
    local t = ctx.touched[lane]
    if not t then
      t = {items = 0, tokens = 0, recs = {}, toks = {}}
      ctx.touched[lane] = t
      ctx.order[#ctx.order + 1] = lane
    end
    t.recs[#t.recs + 1] = ARGV[o + 1]
    t.toks[#t.toks + 1] = tok
    t.items = t.items + 1
    t.tokens = t.tokens + tok
    t.rep = rep
    ctx.tokens = ctx.tokens + tok
    ctx.items = ctx.items + 1
    if from_store[i + 1] then
      fed_items, fed_tokens = fed_items + 1, fed_tokens + tok
    else
      new_items, new_tokens = new_items + 1, new_tokens + tok
    end
    out[#out + 1] = tonumber(lane)
  end
end
-- unpack() stops near 8,000 values: the new ids go in slices.
for s = 1, #fresh_sums, 2000 do
  redis.call('HSET', job_sums, unpack(fresh_sums, s, math.min(s + 1999, #fresh_sums)))
end

-- Lanes grow and counters move once per call and lane, not once per item.
for sig, ctx in pairs(ctxs) do
  local ik = ctx.ik
  -- Per lane: its two lists and one read and one write of its hash. The sorted sets of the
  -- instance take every touched lane in one ZADD each: a call of 1,000 items touches hundreds
  -- of lanes, and every redis.call costs a few microseconds.
  local zl, zt, zf, zr = {}, {}, {}, {}
  for _, lane in ipairs(ctx.order) do
    local t = ctx.touched[lane]
    local mk = base .. ':lanemeta:' .. ctx.inst .. ':' .. lane
    redis.call('RPUSH', base .. ':lane:' .. ctx.inst .. ':' .. lane, unpack(t.recs))
    redis.call('RPUSH', base .. ':lanetok:' .. ctx.inst .. ':' .. lane, unpack(t.toks))
    local m = redis.call('HMGET', mk, 'items', 'tokens', 'rep', 'since_ms')
    local items, tokens = num(m[1]) + t.items, num(m[2]) + t.tokens
    local rep = math.max(t.rep, num(m[3]))
    redis.call('HSET', mk, 'items', items, 'tokens', tokens, 'rep', rep, 'last_ms', now, 'since_ms', m[4] or now)
    if rep ~= tonumber(m[3]) then zl[#zl + 1] = rep; zl[#zl + 1] = lane end
    zt[#zt + 1] = now; zt[#zt + 1] = lane
    zf[#zf + 1] = rep; zf[#zf + 1] = lane
    if lane_is_ready(cfg, items, tokens, rep) then zr[#zr + 1] = lane; zr[#zr + 1] = lane end
  end
  if #zl > 0 then redis.call('ZADD', ik .. ':lanes', unpack(zl)) end
  if #zt > 0 then
    redis.call('ZADD', ik .. ':touch', unpack(zt))
    redis.call('ZADD', ik .. ':fill', unpack(zf))
  end
  if #zr > 0 then redis.call('ZADD', ik .. ':ready', unpack(zr)) end
  if ctx.items > 0 then
    local tokens = redis.call('HINCRBY', ik, 'tokens', ctx.tokens)
    redis.call('HINCRBY', ik, 'items', ctx.items)
    redis.call('HSET', ik, 'last_intake_ms', now)
    if ctx.st == 'staged' or ctx.st == 'warming' then
      redis.call('ZADD', base .. ':staged', tokens, ctx.inst)
    end
  end
end
-- The job's and the model's counters, in the order they were always written (a hash keeps its
-- fields in insertion order; migrations/0003's round trip compares them byte for byte).
if new_items > 0 then
  redis.call('HINCRBY', base .. ':in:' .. job, 'submitted', new_items)
  redis.call('HINCRBY', base .. ':in:' .. job, 'submitted_tokens', new_tokens)
end
if new_items + fed_items > 0 then
  redis.call('HINCRBY', intake_key, 'tokens', new_tokens + fed_tokens)
  redis.call('HINCRBY', intake_key, 'items', new_items + fed_items)
end
if new_items > 0 then redis.call('HINCRBY', intake_key, 'submitted', new_items) end
if fed_items > 0 then
  redis.call('HINCRBY', intake_key, 'stored_tokens', -fed_tokens)
  redis.call('HINCRBY', intake_key, 'stored_items', -fed_items)
end
if new_items + fed_items > 0 then
  -- claim.lua ends cleanup mode when it sees intake newer than the cleanup's start.
  redis.call('HSET', intake_key, 'last_intake_ms', now)
end
return out
