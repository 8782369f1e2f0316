#!lua
-- schema_init.lua: give an empty Redis the current key layout in one step
-- (conductor/redis_contract/schema.py). A fleet starts together: the layout written step by step
-- (1, 2, ... N, a migration each) let another process read a half-way version and refuse to start
-- (issue 37). An empty Redis has nothing to move, so the current version is written at once.
--
-- KEYS[1] schema  cdr:schema
-- KEYS[2] models  cdr:models
-- KEYS[3] jobs    cdr:jobs
-- ARGV[1] version the current schema version (an integer in 1..1000000)
-- Returns: the version Redis holds after the call: ARGV[1] when it was empty (or already there), the
--   stored one when it had one; 0 when it holds conductor registries without a version (nothing
--   written: such a Redis goes through the migrations under their lease). Errors, with nothing
--   written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused).
-- Invariants: a stored version is never replaced; the registries every writer fills first are read
--   before the only write. On a Redis Cluster the three keys live in three slots: schema.py reads
--   and writes there without this script (SET NX; see _write_empty).
--@include lib.lua

if #ARGV ~= 1 then return redis.error_reply('ERR_ARG argv: version') end
local version = tonumber(ARGV[1])
if not int_in(version, 1, 1000000) then
  return redis.error_reply('ERR_ARG version: must be an integer in 1..1000000')
end

local refused = acl_refused(function(ok)
  return ok('GET', KEYS[1]) and ok('EXISTS', KEYS[2]) and ok('EXISTS', KEYS[3]) and ok('SET', KEYS[1])
end)
if refused then return refused end

local have = redis.call('GET', KEYS[1])
if have then return tonumber(have) or -1 end
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('SET', KEYS[1], version)
return version
