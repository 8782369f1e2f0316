#!lua flags=allow-oom
-- allow-oom: compacting frees memory (about 135 bytes an id out, 16 in); a full Redis needs it most.
-- compact_ids.lua: answered ids of a job leave its id registry and done marks for their packed
-- form (lib_packed.lua), run by the maintenance lease holder (conductor/tier/compact_ids.py).
--
-- KEYS[1] items   cdr:{model}:job:J:items   (done marks: id -> d)
-- KEYS[2] sums    cdr:{model}:in:J:sums     (the id registry: id -> content sum)
-- KEYS[3] packed  cdr:{model}:job:J:packed  (lib_packed.lua)
-- KEYS[4] state   cdr:{model}:state         (read only: paused)
-- ARGV[1] k       bucket digits (1..4) for a job that has no packed form yet (else its own 'k' holds)
-- ARGV[2] n       how many ids follow, 1..2000
-- ARGV[3..]       the ids, each 1..512 bytes
-- Returns: the number of ids packed now. An id is packed only when it is answered (mark 'd') and
--   its registry holds its plain sum (16 hex digits): one registered before sums were kept ('-'),
--   an unknown or repeated one (one waiting in a store segment is in M:in:J:stored, not the
--   registry) is skipped.
-- Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: an id moves whole: its packed record, its registry entry and its done mark change in
--   one step, so every answered id is in exactly one of the two forms and 'n' counts the packed.
--@include lib.lua
--@include lib_packed.lua

local items_key, sums_key, packed_key, state_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local k_arg, n = tonumber(ARGV[1]), tonumber(ARGV[2])
if not int_in(k_arg, 1, 4) then return redis.error_reply('ERR_ARG k: bucket digits must be 1..4') end
if not int_in(n, 1, 2000) then return redis.error_reply('ERR_ARG n: 1..2000 ids expected') end
if #ARGV ~= 2 + n then
  return redis.error_reply('ERR_ARG argv: expected ' .. (2 + n) .. ' arguments, got ' .. #ARGV)
end
local ids = {}
for i = 1, n do
  local id = ARGV[i + 2]
  if #id < 1 or #id > RULES.MAX_ID_BYTES then
    return redis.error_reply('ERR_ARG id: must be 1..' .. RULES.MAX_ID_BYTES .. ' bytes at ' .. (i - 1))
  end
  ids[i] = id
end
local refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('HMGET', items_key) and ok('HMGET', sums_key) and ok('HMGET', packed_key)
    and ok('HSET', packed_key) and ok('HINCRBY', packed_key) and ok('HDEL', items_key) and ok('HDEL', sums_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

local marks = redis.call('HMGET', items_key, unpack(ids))
local sums = redis.call('HMGET', sums_key, unpack(ids))
local k = tonumber(redis.call('HGET', packed_key, 'k')) or k_arg
local take, seen, buckets, order = {}, {}, {}, {}
for i = 1, n do
  local id, sum = ids[i], sums[i]
  if marks[i] == 'd' and hex_ok(sum, RULES.SUM_HEX) and not seen[id] then
    seen[id] = true
    take[#take + 1] = id
    local field, fp = packed_place(id, k)
    if not buckets[field] then
      buckets[field] = {}
      order[#order + 1] = field
    end
    local b = buckets[field]
    b[#b + 1] = fp .. hex_bin(sum)
  end
end
if #take == 0 then return 0 end
local old = redis.call('HMGET', packed_key, unpack(order))
local writes = {'k', k}
for j, field in ipairs(order) do
  writes[#writes + 1] = field
  writes[#writes + 1] = (old[j] or '') .. table.concat(buckets[field])
end
redis.call('HSET', packed_key, unpack(writes))
redis.call('HINCRBY', packed_key, 'n', #take)
redis.call('HDEL', items_key, unpack(take))
redis.call('HDEL', sums_key, unpack(take))
return #take
