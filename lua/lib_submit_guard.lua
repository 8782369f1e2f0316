-- lib_submit_guard.lua: submit.lua's ACL pre-check (lib.lua acl_refused): every command submit.lua
-- and its includes may call, on each key or key pattern, before the first write.
-- Keys: none read or written. Invariant: a command added to submit.lua or its includes is added
--   here too (tests/test_script_acl_atomicity.py denies each in turn).
--@include lib.lua

-- Every command this call may run, on each key or key pattern, before the first write (lib.lua
-- acl_refused): a refusal halfway would leave the writes before it.
-- Returns the error reply to return ('NOPERM ...', nothing written), or nil.
local function submit_refused(base, state_key, intake_key, job)
  local I, L, ji = base .. ':inst:0000000000000000:0', ':0000000000000000:0:0', base .. ':in:' .. job
  local sh, it = base .. ':shape:0000000000000000', intake_key
  local refused = acl_refused(function(ok)
    return ok('HGET', state_key) and ok('HGET', it) and ok('HINCRBY', it) and ok('HSET', it)
      and ok('HMGET', ji .. ':sums') and ok('HSET', ji .. ':sums') and ok('HINCRBY', ji) and ok('HGET', sh)
      and ok('HSET', sh) and ok('HSETNX', sh)
      and ok('HGET', I) and ok('HMGET', I) and ok('HSET', I) and ok('HINCRBY', I) and ok('ZADD', base .. ':staged_age')
      and ok('ZADD', base .. ':staged') and ok('ZRANGE', I .. ':lanes') and ok('ZADD', I .. ':lanes')
      and ok('SPOP', I .. ':free') and ok('ZADD', I .. ':touch') and ok('ZADD', I .. ':fill')
      and ok('ZADD', I .. ':ready') and ok('RPUSH', base .. ':lane' .. L) and ok('RPUSH', base .. ':lanetok' .. L)
      and ok('HMGET', base .. ':lanemeta' .. L) and ok('HSET', base .. ':lanemeta' .. L) and ok('TIME')
      and ok('LPUSH', base .. ':bell') and ok('LTRIM', base .. ':bell') and ok('HMGET', base .. ':job:0:items')
      and ok('HGET', base .. ':job:0:packed') and ok('HMGET', base .. ':job:0:packed')
      and ok('HGET', ji .. ':stored') and ok('HMGET', ji .. ':stored') and ok('HSET', ji .. ':stored')
      and ok('HINCRBY', ji .. ':stored')
      and ok('HMGET', ji) and ok('ZADD', base .. ':hot')
  end)
  return refused
end
