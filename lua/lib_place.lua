-- lib_place.lua: submit.lua's items placed, one by one, once every check has passed: each new id
-- joins a lane of its shape (lib_intake.lua choose_lane), a new signature's prefix is stored, and the
-- job's and the model's intake counters move once per call.
-- Keys: M:shape:S (HSETNX, HGET prefix; HINCRBY, HSET stored_tokens), M:in:J (HINCRBY), M:intake
--   (HINCRBY, HSET last_intake_ms); through lib_intake.lua what choose_lane and ring_doorbell touch.
-- Invariants: an id the job has already (known, or twice in the call) is not placed again (-1); an id
--   fed from a store segment counts as submitted once, when registered, and moves from stored to
--   waiting when placed (or leaves stored, unplaced, when it was answered meanwhile).
--@include lib.lua
--@include lib_intake.lua

-- The call's n items (3 fields each from argv[3]) placed: call is lib_submit_args.lua's check_items
-- reply; known, answered and from_store (by item) lib_job_ids.lua id_conflicts'. Returns the reply
-- (per item its lane, or -1) and k, the counts placed: new (never submitted), fed (from the store)
-- and gone (from the store, answered meanwhile), in items and tokens.
local function place_items(intake, argv, n, call, known, answered, from_store)
  local base, cfg, class = intake.base, intake.cfg, intake.class
  local ids, toks, mts, prefixes = call.ids, call.toks, call.mts, call.prefixes
  local k = {new_items = 0, new_tokens = 0, fed_items = 0, fed_tokens = 0, gone_items = 0, gone_tokens = 0,
    shapes = {}}
  local out, seen = {}, {}
  -- k's placed counts summed in locals (into k after the loop): four table writes an item fewer
  local new_items, new_tokens, fed_items, fed_tokens = 0, 0, 0, 0
  -- Per signature of the call, its qualified signature and its shape_ctx: looked up once, not per item.
  local qsigs, ctxs = {}, {}
  local fmt = string.format
  for i = 0, n - 1 do
    local o = 3 + 3 * i
    local id, tok = ids[i + 1], toks[i + 1]
    if known[i + 1] or seen[id] then
      out[i + 1] = -1
    elseif answered[i + 1] then
      -- fed from the store but answered meanwhile (cancel, expiry): nothing left to run
      seen[id] = true
      out[i + 1] = -1
      k.gone_items, k.gone_tokens = k.gone_items + 1, k.gone_tokens + tok
      local qsig = qualified(class, argv[o])
      k.shapes[qsig] = (k.shapes[qsig] or 0) + tok
    else
      seen[id] = true
      local sig = argv[o]
      local qsig, ctx = qsigs[sig], ctxs[sig]
      if not ctx then
        qsig = qualified(class, sig)
        ctx = shape_ctx(intake, qsig, sig)
        qsigs[sig], ctxs[sig] = qsig, ctx
      end
      if prefixes[sig] ~= false then
        -- the signature's prefix, stored once under the signature (what a producer's next call may
        -- leave out) and under a qualified signature's key, which workers read it from
        local prefix = prefixes[sig]
        if prefix then redis.call('HSETNX', base .. ':shape:' .. sig, 'prefix', prefix) end
        if qsig ~= sig then
          prefix = prefix or redis.call('HGET', base .. ':shape:' .. sig, 'prefix')
          redis.call('HSETNX', base .. ':shape:' .. qsig, 'prefix', prefix)
        end
        prefixes[sig] = false
      end
      local lane, rep = choose_lane(cfg, ctx, tok)
      local t = ctx.touched[lane]
      if not t then
        -- num: the reply's lane number, converted once per lane rather than once per item
        t = {items = 0, tokens = 0, recs = {}, toks = {}, num = tonumber(lane)}
        ctx.touched[lane] = t
        ctx.order[#ctx.order + 1] = lane
      end
      -- t.items counts the lists' entries (no length operator, a search in Lua 5.1, per item)
      local at = t.items + 1
      t.recs[at] = argv[o + 1]
      -- a whole number (check_items): '%d' writes what Redis's own '%.17g' would, at a third of the cost
      -- (a concatenation's '%.14g', also the same digits, costs more than the C call: a float format)
      t.toks[at] = fmt('%d', tok)
      t.items = at
      t.tokens = t.tokens + tok
      t.rep = rep
      ctx.tokens = ctx.tokens + tok
      ctx.items = ctx.items + 1
      ctx.out = ctx.out + mts[i + 1]
      if from_store[i + 1] then
        fed_items, fed_tokens = fed_items + 1, fed_tokens + tok
        k.shapes[qsig] = (k.shapes[qsig] or 0) + tok
      else
        new_items, new_tokens = new_items + 1, new_tokens + tok
      end
      out[i + 1] = t.num
    end
  end
  k.new_items, k.new_tokens, k.fed_items, k.fed_tokens = new_items, new_tokens, fed_items, fed_tokens
  return out, k
end

-- The job's and the model's counters from the counts k (place_items), and the doorbell.
local function count_placed(intake, job, intake_key, k)
  local base, cfg, now = intake.base, intake.cfg, intake.now
  -- The job's and the model's counters, in the order they were always written (a hash keeps its
  -- fields in insertion order; migrations/0003's round trip compares them byte for byte). Items fed
  -- from the store were submitted when registered: they move from stored to waiting.
  if k.new_items > 0 then
    redis.call('HINCRBY', base .. ':in:' .. job, 'submitted', k.new_items)
    redis.call('HINCRBY', base .. ':in:' .. job, 'submitted_tokens', k.new_tokens)
  end
  local placed_items, placed_tokens = k.new_items + k.fed_items, k.new_tokens + k.fed_tokens
  if placed_items > 0 then
    redis.call('HINCRBY', intake_key, 'tokens', placed_tokens)
    redis.call('HINCRBY', intake_key, 'items', placed_items)
  end
  if k.new_items > 0 then redis.call('HINCRBY', intake_key, 'submitted', k.new_items) end
  if k.fed_items + k.gone_items > 0 then
    redis.call('HINCRBY', intake_key, 'stored_tokens', -(k.fed_tokens + k.gone_tokens))
    redis.call('HINCRBY', intake_key, 'stored_items', -(k.fed_items + k.gone_items))
    for shape, tok in pairs(k.shapes) do shape_stored_add(base, shape, -tok) end
  end
  if placed_items > 0 then
    -- claim.lua ends cleanup mode when it sees intake newer than the cleanup's start.
    redis.call('HSET', intake_key, 'last_intake_ms', now)
    ring_doorbell(base, cfg, placed_tokens, placed_items)
  end
end
