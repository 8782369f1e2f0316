-- lib_requeue_prologue.lua: the prologue fail.lua and reclaim.lua share, after their argument
-- checks and before their first write: the ACL pre-check of every command they may call (the
-- requeue's, the prologue's and the script's own), the pause check, the config load and the clock.
-- Keys: KEYS of both scripts: base, cfg, state, batches, reclaimed (reads only here).
-- Invariant: nothing is written before it returns, and nothing when it refuses.
--@include lib.lua
--@include lib_requeue.lua

-- keys: the script's KEYS; checks(ok): the script's own commands as a chain for lib.lua
-- acl_refused (nil for none). Returns rq, the requeue context (lib_requeue.lua), or nil and the
-- error reply to return ('NOPERM ...', 'PAUSED ...').
local function requeue_prologue(keys, checks)
  local rq = {base = keys[1], cfg_key = keys[2], state_key = keys[3], batches_key = keys[4], reclaimed_key = keys[5]}
  local refused = acl_refused(function(ok)
    return requeue_acl(rq, ok) and ok('HGET', rq.state_key) and ok('HMGET', rq.cfg_key)
      and ok('XPENDING', rq.batches_key) and (checks == nil or checks(ok)) and ok('TIME')
  end)
  if refused then return nil, refused end
  refused = paused(rq.state_key)
  if refused then return nil, refused end
  rq.cfg = load_cfg(rq.cfg_key)
  rq.now = now_ms()
  return rq
end
