#!lua flags=allow-oom
-- allow-oom: a repair must work on a full Redis. The shebang also makes a cluster node refuse any
-- key outside the slot of the model's hash tag.
-- fail_stored.lua: the items of a store segment that is missing or damaged (conductor inspect
-- --verify --repair; conductor/verify/tier_truth.py) are answered with an error result each, so that
-- they are failed, not silently dropped, and the segment's index record goes.
--
-- KEYS[1] intake   cdr:{model}:intake            (stored_tokens, stored_items)
-- KEYS[2] state    cdr:{model}:state             (failed; read: paused)
-- KEYS[3] segs     cdr:{model}:segs
-- KEYS[4] seg      cdr:{model}:seg:<name>        (the index record: seq, items, tokens)
-- KEYS[5] sums     cdr:{model}:in:J:sums         (the job's id registry)
-- KEYS[6] job      cdr:{model}:job:J             (failed)
-- KEYS[7] items    cdr:{model}:job:J:items       (done marks)
-- KEYS[8] results  cdr:{model}:job:J:results
-- KEYS[9] stored   cdr:{model}:in:J:stored       (the job's store-waiting ids, packed: lib_packed.lua)
-- KEYS[10] ids     cdr:{model}:seg:<name>:ids    (the segment's id list)
-- KEYS[11] base    cdr:{model}                   (never a key: declared so that Redis refuses this call
--                                                 while the slot is half moved, as it names the shape's keys)
-- (and cdr:{model}:shape:S stored_tokens and cdr:{model}:shape:S:segs, S the index record's shape)
-- ARGV[1] name     the segment (32 hex digits)
-- ARGV[2..]        2 per item: id, its error result record (JSON, as complete.lua's 'r' field)
-- Returns: {failed, skipped}: items answered with their error result; ids given that no longer
--   wait in this segment (placed in a lane meanwhile, answered already, or not its ids): left as
--   they are. {0, 0} when the segment is not registered (nothing written).
-- Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused); 'PAUSED ...'.
-- Invariants: an id is answered only while it waits in this segment (in its id list and in the
--   job's stored ids), once: it leaves the stored ids for the registry (its plain sum), gets a done
--   mark, one result record and one count in failed (one a cancel answered while it waited only
--   leaves the stored ids: it has its answer); stored_items goes down by the items that leave
--   and stored_tokens by their share of the segment's tokens (the file that held each item's
--   tokens is gone), and its shape's stored tokens (M:shape:S stored_tokens, S the index record's
--   'shape') by the same share.
--@include lib.lua
--@include lib_packed.lua

local intake_key, state_key, segs_key, seg_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local sums_key, job_key, items_key, results_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local stored_key, ids_key, base = KEYS[9], KEYS[10], KEYS[11]
local name = ARGV[1]
if not hex_ok(name, RULES.SEGMENT_NAME_HEX) then
  return redis.error_reply('ERR_ARG name: must be 32 lowercase hex digits')
end
local n = (#ARGV - 1) / 2
if not int_in(n, 0, RULES.MAX_CALL_ITEMS) then
  return redis.error_reply('ERR_ARG argv: 0..' .. RULES.MAX_CALL_ITEMS .. ' (id, result) pairs expected')
end
local ids = {}
for i = 1, n do
  local id, rec = ARGV[2 * i], ARGV[2 * i + 1]
  if #id < 1 or #id > RULES.MAX_ID_BYTES then
    return redis.error_reply('ERR_ARG id: must be 1..' .. RULES.MAX_ID_BYTES .. ' bytes at item ' .. (i - 1))
  end
  if string.byte(rec, 1) ~= 123 then
    return redis.error_reply('ERR_ARG result: must be a JSON object at item ' .. (i - 1))
  end
  ids[i] = id
end
local refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('HMGET', seg_key) and ok('HSET', sums_key) and ok('HMGET', items_key)
    and ok('HSET', items_key) and ok('XADD', results_key) and ok('HINCRBY', job_key) and ok('HINCRBY', state_key)
    and ok('HINCRBY', intake_key) and ok('ZREM', segs_key) and ok('DEL', seg_key) and ok('LRANGE', ids_key)
    and ok('DEL', ids_key) and ok('HGET', stored_key) and ok('HMGET', stored_key) and ok('HSET', stored_key)
    and ok('HINCRBY', stored_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
local meta = redis.call('HMGET', seg_key, 'seq', 'items', 'tokens', 'shape')
if not meta[1] then return {0, 0} end
-- the shape's keys, named by the index record: checked once it is read, still before any write (a
-- role that may repair a segment but not touch its shape is refused whole, not halfway)
if meta[4] then
  local shape_key = base .. ':shape:' .. meta[4]
  refused = acl_refused(function(ok)
    return ok('HINCRBY', shape_key) and ok('HSET', shape_key)
      and ok('ZREM', shape_key .. ':segs')
  end)
  if refused then return refused end
end
local mine = {}
for _, id in ipairs(redis.call('LRANGE', ids_key, 0, -1)) do mine[id] = true end
-- each id given once, and only one of this segment's: then where it is now
local want, once = {}, {}
for i = 1, n do
  if mine[ids[i]] and not once[ids[i]] then
    once[ids[i]] = true
    want[#want + 1] = i
  end
end
local stored = packed_view(stored_key, ids, want)
local leave = {}
for _, i in ipairs(want) do
  if stored.sums[i] then leave[#leave + 1] = i end
end
local marks = {}
if #leave > 0 then
  local part = {}
  for j, i in ipairs(leave) do part[j] = ids[i] end
  marks = redis.call('HMGET', items_key, unpack(part))
end

local failed, plain = 0, {}
for j, i in ipairs(leave) do
  plain[#plain + 1] = ids[i]
  plain[#plain + 1] = stored.sums[i]
  if marks[j] ~= 'd' then
    failed = failed + 1
    redis.call('XADD', results_key, '*', 'id', ids[i], 'r', ARGV[2 * i + 1])
    redis.call('HSET', items_key, ids[i], 'd')
  end
end
if #leave > 0 then
  packed_drop(stored, leave)
  hset_pairs(sums_key, plain)
  local items, tokens = num(meta[2]), num(meta[3])
  redis.call('HINCRBY', intake_key, 'stored_items', -#leave)
  local share = math.floor(tokens * #leave / math.max(items, 1))
  redis.call('HINCRBY', intake_key, 'stored_tokens', -share)
  -- a segment registered before shapes counted their stored tokens names no shape: nothing counted it
  if meta[4] then shape_stored_add(base, meta[4], -share) end
end
if failed > 0 then
  redis.call('HINCRBY', job_key, 'failed', failed)
  redis.call('HINCRBY', state_key, 'failed', failed)
end
redis.call('ZREM', segs_key, name)
if meta[4] then redis.call('ZREM', base .. ':shape:' .. meta[4] .. ':segs', name) end
redis.call('DEL', seg_key, ids_key)
return {failed, n - failed}
