-- lib_repair.lua: repair.lua's rewrites, one lane at a time and then the instance: each field that
-- differs from the truth (lib_lane_truth.lua) is written and recorded as a change. Every function
-- takes rp, the repair context repair.lua builds: base, ik (M:inst:S:E), inst, cfg, now, exists (the
-- instance hash is there), out (the changes, 4 strings each: key, field, old, new).
-- Keys: M:lanemeta:S:E:L (HMGET, HSET, HSETNX), M:inst:S:E (HGET, HMGET, HSET) and its lanes, fill,
--   ready (ZSCORE, ZADD, ZREM) and free (SREM, SADD) sets, M:staged (ZSCORE, ZADD, ZREM).
-- Invariant: writes only what differs from the truth it is given, and records every write; item
--   records and token lists are never touched.
--@include lib.lua

local function changed(rp, key, field, old, new)
  local out = rp.out
  out[#out + 1] = key
  out[#out + 1] = field
  out[#out + 1] = old and tostring(old) or ''
  out[#out + 1] = new and tostring(new) or ''
end

-- One lane rewritten from its truth t = {n (items), tok (tokens), mx (longest)}: its meta, its rep in
-- the lanes set, the free set, its fill score and its ready membership under rp.cfg.
local function repair_lane(rp, lane, t)
  local base, ik, inst, cfg, now, exists = rp.base, rp.ik, rp.inst, rp.cfg, rp.now, rp.exists
  local mk = base .. ':lanemeta:' .. inst .. ':' .. lane
  local meta = redis.call('HMGET', mk, 'items', 'tokens', 'rep')
  local has_meta = meta[1] or meta[2] or meta[3]
  local rep = num(meta[3])
  if t.n > 0 or has_meta then
    if num(meta[1]) ~= t.n then
      redis.call('HSET', mk, 'items', t.n)
      changed(rp, mk, 'items', meta[1], t.n)
    end
    if num(meta[2]) ~= t.tok then
      redis.call('HSET', mk, 'tokens', t.tok)
      changed(rp, mk, 'tokens', meta[2], t.tok)
    end
    if rep < t.mx or not meta[3] then
      local new = math.max(rep, t.mx)
      redis.call('HSET', mk, 'rep', new)
      changed(rp, mk, 'rep', meta[3], new)
      rep = new
    end
    if t.n > 0 then
      redis.call('HSETNX', mk, 'last_ms', now)
      redis.call('HSETNX', mk, 'since_ms', now)
    end
    local score = redis.call('ZSCORE', ik .. ':lanes', lane)
    if tonumber(score) ~= rep then
      redis.call('ZADD', ik .. ':lanes', rep, lane)
      changed(rp, ik .. ':lanes', 'lane ' .. lane .. ' rep', score, rep)
    end
    if redis.call('SREM', ik .. ':free', lane) == 1 then changed(rp, ik .. ':free', 'lane ' .. lane, 1, 0) end
  else
    -- Listed but without meta or items: a lane that was never retired; retire it.
    local score = redis.call('ZSCORE', ik .. ':lanes', lane)
    if score then
      redis.call('ZREM', ik .. ':lanes', lane)
      changed(rp, ik .. ':lanes', 'lane ' .. lane .. ' rep', score, nil)
      if exists then redis.call('SADD', ik .. ':free', lane) end
    end
  end
  local fs = redis.call('ZSCORE', ik .. ':fill', lane)
  local in_ready = redis.call('ZSCORE', ik .. ':ready', lane)
  if t.n > 0 then
    local w = rep
    if tonumber(fs) ~= w then
      redis.call('ZADD', ik .. ':fill', w, lane)
      changed(rp, ik .. ':fill', 'lane ' .. lane, fs, w)
    end
    local should = lane_is_ready(cfg, t.n, t.tok, rep)
    if should and not in_ready then
      redis.call('ZADD', ik .. ':ready', lane, lane)
      changed(rp, ik .. ':ready', 'lane ' .. lane, 0, 1)
    elseif in_ready and not should then
      redis.call('ZREM', ik .. ':ready', lane)
      changed(rp, ik .. ':ready', 'lane ' .. lane, 1, 0)
    end
  else
    if fs then
      redis.call('ZREM', ik .. ':fill', lane)
      changed(rp, ik .. ':fill', 'lane ' .. lane, fs, nil)
    end
    if in_ready then
      redis.call('ZREM', ik .. ':ready', lane)
      changed(rp, ik .. ':ready', 'lane ' .. lane, 1, 0)
    end
  end
end

-- The instance's index version, tokens and items, and its place in M:staged, from the lanes' totals.
local function repair_inst(rp, total_tok, total_items)
  local base, ik, inst, cfg = rp.base, rp.ik, rp.inst, rp.cfg
  if rp.exists then
    -- fill and ready now follow the current config (claim.lua would re-derive them otherwise).
    local idx = redis.call('HGET', ik, 'idx')
    if idx ~= index_version(cfg) then
      redis.call('HSET', ik, 'idx', index_version(cfg))
      changed(rp, ik, 'idx', idx, index_version(cfg))
    end
    local cur = redis.call('HMGET', ik, 'tokens', 'items', 'state')
    if num(cur[1]) ~= total_tok then
      redis.call('HSET', ik, 'tokens', total_tok)
      changed(rp, ik, 'tokens', cur[1], total_tok)
    end
    if num(cur[2]) ~= total_items then
      redis.call('HSET', ik, 'items', total_items)
      changed(rp, ik, 'items', cur[2], total_items)
    end
    local sc = redis.call('ZSCORE', base .. ':staged', inst)
    if cur[3] == 'staged' or cur[3] == 'warming' then
      if tonumber(sc) ~= total_tok then
        redis.call('ZADD', base .. ':staged', total_tok, inst)
        changed(rp, base .. ':staged', inst, sc, total_tok)
      end
    elseif sc then
      redis.call('ZREM', base .. ':staged', inst)
      changed(rp, base .. ':staged', inst, sc, nil)
    end
  else
    local sc = redis.call('ZSCORE', base .. ':staged', inst)
    if sc then
      redis.call('ZREM', base .. ':staged', inst)
      changed(rp, base .. ':staged', inst, sc, nil)
    end
  end
end
