-- lib_repair_items.lua: what repair_items_batch.lua, repair_items_lane.lua and repair_items_done.lua
-- share (conductor inspect --verify --repair; conductor/verify/repair.py): one place's items read
-- and sorted by whether they have a result, whether a job of the model knows them, or neither; the
-- known ones given back to the reclaimed list; the place rewritten to hold only what stays.
-- Keys: the place's list and its token list (LRANGE, DEL, RPUSH), M:job:J:items and M:job:J:packed
--   (lib_packed.lua item_done), M:in:J:sums (HGET), M:reclaimed (RPUSH), M:state reclaimed_items.
-- Invariants: place_items only reads, and refuses (nothing written) a record that does not decode or
--   a lane whose token list differs from it in length; an item leaves for the reclaimed list with its
--   record as it is, and the model's reclaimed_items counter moves with it.
--@include lib.lua
--@include lib_packed.lua

-- The commands every one of the three may call on the place (list lk, token list tk or nil), as
-- checks for lib.lua acl_refused; job keys by one name of their pattern.
local function place_ok(ok, base, state_key, lk, tk)
  local jk = base .. ':job:0'
  return ok('HGET', state_key) and ok('LRANGE', lk) and (not tk or ok('LRANGE', tk))
    and ok('HGET', jk .. ':items') and ok('HGET', jk .. ':packed') and ok('HMGET', jk .. ':packed')
end

-- What the place holds, read and sorted: p.recs and p.toks (nil without a token list) as read; by
-- position, p.drop (items with a result), p.stay (items left where they are) and, when `known` (a
-- place whose items may go back to the queue), p.keep and p.keep_toks (records and input tokens of
-- the items a job's id registry knows, which do not stay); p.drop_tokens their tokens. Returns p,
-- or nil and the error reply to return.
local function place_items(base, lk, tk, known)
  local recs = redis.call('LRANGE', lk, 0, -1)
  local toks = tk and redis.call('LRANGE', tk, 0, -1)
  if toks and #toks ~= #recs then
    return nil, redis.error_reply('ERR_STATE lane: ' .. lk .. ' holds ' .. #recs .. ' items but its token list ' ..
      #toks .. ' tokens')
  end
  local p = {recs = recs, toks = toks, keep = {}, keep_toks = {}, stay = {}, drop = {}, drop_tokens = 0}
  for i, rec in ipairs(recs) do
    local ok, it = pcall(cjson.decode, rec)
    if not ok or type(it) ~= 'table' or type(it[1]) ~= 'string' or type(it[2]) ~= 'string'
        or type(it[3]) ~= 'number' then
      return nil, redis.error_reply('ERR_STATE ' .. lk .. ' holds an item record that does not decode')
    end
    if item_done(base .. ':job:' .. it[2], it[1]) then  -- a done mark, or packed (lib_packed.lua)
      p.drop[#p.drop + 1] = i
      p.drop_tokens = p.drop_tokens + (toks and (tonumber(toks[i]) or 0) or it[3])
    elseif known and redis.call('HGET', base .. ':in:' .. it[2] .. ':sums', it[1]) then
      p.keep[#p.keep + 1] = rec
      p.keep_toks[#p.keep_toks + 1] = it[3]
    else
      p.stay[#p.stay + 1] = i
    end
  end
  return p
end

local function push(key, list)  -- unpack() stops near 8,000 values
  for s = 1, #list, 1000 do redis.call('RPUSH', key, unpack(list, s, math.min(s + 999, #list))) end
end

-- The place keeps only the items that stay (its list, and its token list when it has one), when
-- any left it.
local function keep_stays(lk, tk, p)
  if #p.keep == 0 and #p.drop == 0 then return end
  local left, left_toks = {}, {}
  for _, i in ipairs(p.stay) do
    left[#left + 1] = p.recs[i]
    if tk then left_toks[#left_toks + 1] = p.toks[i] end
  end
  redis.call('DEL', lk)
  push(lk, left)
  if tk then
    redis.call('DEL', tk)
    push(tk, left_toks)
  end
end

-- The kept items to the reclaimed list as batches of their shape instance and lane (served first),
-- entries of at most 256 items: claim.lua unpacks what it takes of one entry.
local function requeue_kept(reclaimed_key, state_key, sig, ep, lane, dv, p)
  local keep, keep_toks = p.keep, p.keep_toks
  for s = 1, #keep, 256 do
    local t, r = {}, {}
    for i = s, math.min(s + 255, #keep) do
      t[#t + 1] = keep_toks[i]
      r[#r + 1] = keep[i]
    end
    redis.call('RPUSH', reclaimed_key, cmsgpack.pack({sig, ep, lane, dv, t, r}))
  end
  if #keep > 0 then redis.call('HINCRBY', state_key, 'reclaimed_items', #keep) end
end
