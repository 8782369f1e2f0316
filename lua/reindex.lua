#!lua flags=allow-oom
-- allow-oom: re-deriving indices moves no item and must work on a full Redis, which drains. The
-- shebang also makes a cluster node refuse any key outside the slot of the model's hash tag.
-- reindex.lua: re-derive a shape instance's lane indices after the reference contract or mode
-- changed (the first worker registered after items waited, or `conductor config`).
--
-- KEYS[1] base   cdr:{model}
-- KEYS[2] cfg    cdr:{model}:cfg
-- KEYS[3] state  cdr:{model}:state
-- ARGV[1] inst   the shape instance "sig:epoch"
-- Returns: 1 when the instance was re-derived, 0 when it was already current or is gone.
-- Invariant: afterwards every non-empty lane's fill score and ready membership follow the
--   current cfg (budget_tokens, budget_items, mode), the same rule submit.lua and claim.lua apply.
-- Errors, with nothing written: 'ERR_ARG inst: ...'; 'NOPERM ...' when the caller's ACL refuses
--   a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua

local base, cfg_key, state_key = KEYS[1], KEYS[2], KEYS[3]
local inst = ARGV[1]
if not inst or not string.match(inst, '^%x+:%d+$') then
  return redis.error_reply('ERR_ARG inst: must be a shape instance like 0123456789abcdef:1')
end
local ik = base .. ':inst:' .. inst
local refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('HINCRBY', state_key) and ok('HMGET', cfg_key) and ok('HMGET', ik)
    and ok('HSET', ik) and ok('ZRANGE', ik .. ':lanes') and ok('ZADD', ik .. ':fill') and ok('ZADD', ik .. ':ready')
    and ok('HMGET', base .. ':lanemeta:' .. inst .. ':0') and ok('DEL', ik .. ':ready', ik .. ':fill')
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
local cfg = load_cfg(cfg_key)
local h = redis.call('HMGET', base .. ':inst:' .. inst, 'state', 'idx')
if not h[1] or h[2] == index_version(cfg) then return 0 end
reindex(base, state_key, cfg, inst)
return 1
