#!lua flags=allow-oom
-- allow-oom: a fresh worker must register on a Redis over maxmemory (noeviction) to drain it, and
-- Redis refuses a plain HSETNX there (even of a field that exists) and every command in MULTI.
-- The shebang also makes a cluster node refuse any key outside the slot of the model's hash tag.
-- ensure_model.lua: a model's thresholds default where unset, and its consumer group exists.
--
-- KEYS[1] cfg      cdr:{model}:cfg
-- KEYS[2] batches  cdr:{model}:batches   (group "workers", created with the stream if missing)
-- ARGV[1..]        name, value pairs (at most 64): each set only where the field is absent
-- Returns: {fields set, 1 when it created the group else 0}. Errors, with nothing written:
--   'ERR_ARG ...'; 'NOPERM ...' when the caller's ACL refuses a command this call may run
--   (lib.lua acl_refused); WRONGTYPE when the batches key is not a stream.
-- Invariant: a value already set is never changed (an operator's `conductor config` stays);
--   the group is created at '$' once and never reset. Writes nothing when all is in place, so it
--   runs on every registration; it does not check pause (as registration never did).
--@include lib.lua

local cfg_key, batches_key = KEYS[1], KEYS[2]
if #ARGV % 2 ~= 0 or #ARGV > 128 then
  return redis.error_reply('ERR_ARG argv: name, value pairs, at most 64')
end
for i = 1, #ARGV, 2 do
  if not string.match(ARGV[i], '^[a-z_]+$') or #ARGV[i] > 64 or #ARGV[i + 1] > 64 then
    return redis.error_reply('ERR_ARG name: ' .. string.sub(ARGV[i], 1, 64) .. ' is not a threshold name')
  end
end
local refused = acl_refused(function(ok)
  return ok('HSETNX', cfg_key) and ok('XINFO', 'GROUPS', batches_key)
    and ok('XGROUP', 'CREATE', batches_key, GROUP, '$', 'MKSTREAM')
end)
if refused then return refused end
local groups = redis.pcall('XINFO', 'GROUPS', batches_key)
local have = false
if type(groups) == 'table' and groups.err then
  if not string.find(groups.err, 'no such key') then return groups end
else
  for _, g in ipairs(groups) do
    if g[2] == GROUP then have = true end
  end
end
local set = 0
for i = 1, #ARGV, 2 do
  set = set + redis.call('HSETNX', cfg_key, ARGV[i], ARGV[i + 1])
end
if have then return {set, 0} end
redis.call('XGROUP', 'CREATE', batches_key, GROUP, '$', 'MKSTREAM')
return {set, 1}
