#!lua flags=allow-oom
-- allow-oom: a fresh worker must register on a Redis over maxmemory (noeviction) to drain it.
-- The shebang also makes a cluster node refuse any key outside the slot of the model's hash tag.
-- register.lua: a worker registers its contract and starts its heartbeat, in one step.
--
-- KEYS[1] workers    cdr:{model}:workers
-- KEYS[2] cfg        cdr:{model}:cfg
-- KEYS[3] heartbeat  cdr:{model}:hb:<worker>
-- ARGV[1] worker      1..200 bytes
-- ARGV[2] contract    JSON object (what `conductor inspect` shows), at most 4096 bytes
-- ARGV[3] budget_tokens, ARGV[4] budget_items: the worker's contract, which becomes the model's
--         reference for "a full batch" when none is set (the first worker's, seed 001)
-- ARGV[5] heartbeat value (ms since the epoch), ARGV[6] heartbeat TTL in ms (1..86400000)
-- Returns: {budget_tokens set now 0|1, budget_items set now 0|1}. Errors, with nothing written:
--   'ERR_ARG ...'; 'NOPERM ...' when the caller's ACL refuses a command this call may run
--   (lib.lua acl_refused).
-- Invariant: a reference budget already set is never changed; the heartbeat key lives TTL ms.
--@include lib.lua

local workers_key, cfg_key, hb_key = KEYS[1], KEYS[2], KEYS[3]
local worker, contract = ARGV[1], ARGV[2]
local tokens, items, value, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if not worker or #worker < 1 or #worker > 200 then
  return redis.error_reply('ERR_ARG worker: must be 1..200 bytes')
end
if not contract or #contract > 4096 or string.byte(contract, 1) ~= 123 then
  return redis.error_reply('ERR_ARG contract: must be a JSON object of at most 4096 bytes')
end
if not int_in(tokens, 1, RULES.MAX_BATCH_TOKENS) or not int_in(items, 1, RULES.MAX_BATCH_ITEMS) then
  return redis.error_reply('ERR_ARG budget: tokens in 1..' .. RULES.MAX_BATCH_TOKENS .. ' and items in 1..' ..
    RULES.MAX_BATCH_ITEMS)
end
if not int_in(value, 0, 1e15) or not int_in(ttl, 1, 86400000) then
  return redis.error_reply('ERR_ARG heartbeat: a time in ms and a TTL in 1..86400000 ms')
end
local refused = acl_refused(function(ok)
  return ok('HSET', workers_key) and ok('HSETNX', cfg_key) and ok('SET', hb_key)
end)
if refused then return refused end
redis.call('HSET', workers_key, worker, contract)
local set_tokens = redis.call('HSETNX', cfg_key, 'budget_tokens', ARGV[3])
local set_items = redis.call('HSETNX', cfg_key, 'budget_items', ARGV[4])
redis.call('SET', hb_key, ARGV[5], 'PX', ttl)
return {set_tokens, set_items}
