-- lib_lane_truth.lua: what a shape instance's lanes really hold, counted from their lists (the
-- truth repair.lua rewrites counters from).
-- Keys: M:lane:S:E:L (LLEN) and M:lanetok:S:E:L (LRANGE), read only.
-- Invariant: a lane list and its token list have the same length; a lane where they differ is
--   refused (ERR_STATE), since no counter could be right for it.

-- base: cdr:{model}; inst: "S:E"; lanes: lane ids. Returns truth (lane -> {n items, tok tokens,
-- mx longest item}), the instance's tokens and items; or nil and the error reply to return.
local function lane_truth(base, inst, lanes)
  local truth, total_tok, total_items = {}, 0, 0
  for _, lane in ipairs(lanes) do
    local lk = base .. ':lane:' .. inst .. ':' .. lane
    local n = redis.call('LLEN', lk)
    local toks = redis.call('LRANGE', base .. ':lanetok:' .. inst .. ':' .. lane, 0, -1)
    if #toks ~= n then
      return nil, redis.error_reply('ERR_STATE lane: ' .. lk .. ' holds ' .. n .. ' items but its token list ' ..
        #toks .. ' tokens')
    end
    local tok, mx = 0, 0
    for _, v in ipairs(toks) do
      local t = tonumber(v) or 0
      tok = tok + t
      if t > mx then mx = t end
    end
    truth[lane] = {n = n, tok = tok, mx = mx}
    total_tok = total_tok + tok
    total_items = total_items + n
  end
  return truth, total_tok, total_items
end
