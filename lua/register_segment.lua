#!lua
-- The shebang (no flags) makes Redis 7 refuse this script at maxmemory before it runs (as
-- submit.lua is) and, on a cluster node, refuse any key outside the slot of the model's hash tag.
-- register_segment.lua: the disk tier (conductor/tier/spill.py) registers a store segment the producer
-- has written: its index record, its items' ids, and the counts, in one step. A segment written
-- and not registered (the producer died between the two) holds nothing anyone counts: the same
-- items sent again make the same file (its name is derived from its content) and register then.
--
-- KEYS[1] intake  cdr:{model}:intake       (stored_tokens, stored_items, submitted, seg_seq)
-- KEYS[2] job     cdr:{model}:in:J         (the producer's job counters: submitted, submitted_tokens)
-- KEYS[3] sums    cdr:{model}:in:J:sums    (the job's id registry)
-- KEYS[4] segs    cdr:{model}:segs         (segment name -> sequence)
-- KEYS[5] seg     cdr:{model}:seg:<name>   (the index record)
-- KEYS[6] state   cdr:{model}:state        (read only: paused)
-- KEYS[7] stored  cdr:{model}:in:J:stored  (the job's store-waiting ids, packed: lib_packed.lua)
-- KEYS[8] ids     cdr:{model}:seg:<name>:ids (the segment's ids, a list)
-- KEYS[9] base    cdr:{model}              (never a key: declared so that Redis refuses this call while
--                                           the slot is half moved, as it builds key names of its own)
-- (and cdr:{model}:shape:<S> stored_tokens and cdr:{model}:shape:<S>:segs, the shape's count and
--  its segments, and the job's answered packed ids, named from KEYS[9])
-- ARGV[1] name    32 hex digits (conductor/redis_contract/segment_record.py: derived from the content)
-- ARGV[2] job     the job every item belongs to (the records name it)
-- ARGV[3] sig     16 hex digits: the shape signature of every item
-- ARGV[4] path    the file's name in the store
-- ARGV[5] sum     40 hex digits: SHA-1 of the file (the feeder checks it before loading)
-- ARGV[6] tokens  input tokens of the segment's items, ARGV[7] lmin, ARGV[8] lmax: their range
-- ARGV[9..]       2 per item: id, content sum (16 hex digits, submit_stream.content_sum), 1..5000 items
-- Returns: 1 registered; 0 a segment of this name is registered already (nothing written).
--   Errors, with nothing written: 'ERR_ARG <field>: ...'; 'PAUSED ...'; 'NOPERM ...' (lib.lua
--   acl_refused); 'CONFLICT <n> ...' when n ids are the job's with other content; 'KNOWN <n> ...'
--   when n ids are the job's already with this content (another producer was faster: the caller
--   leaves them out, which makes another segment, and registers that).
-- Invariants: each id of the segment is in the job's stored ids (M:in:J:stored, a 16-byte record
--   with its sum; schema 6: no longer a registry entry of about 80 bytes) and in the segment's id
--   list until submit.lua places it in a lane (fail_stored.lua, until it answers it); stored_tokens
--   and stored_items count exactly those items; the job's submitted counters count them once,
--   here (submit.lua does not count them again when it places them).
-- The segment's tokens count in its shape's stored tokens too (M:shape:S stored_tokens, S the
--   signature qualified by the job's class, as submit.lua will place its items; recorded in the
--   index record as 'shape'), so a claim knows a served shape is not at its end while segments of
--   it wait, and the feeder which segments belong to a served shape (issue 37).
-- An id the job has in its registry, its stored ids or its answered packed ids counts as known.
--@include lib.lua
--@include lib_packed.lua
--@include lib_intake.lua

local intake_key, job_key, sums_key, segs_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local seg_key, state_key, stored_key, ids_key, base = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local name, job, sig, path, fsum = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local tokens, lmin, lmax = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local n = (#ARGV - 8) / 2
if not hex_ok(name, RULES.SEGMENT_NAME_HEX) then
  return redis.error_reply('ERR_ARG name: must be 32 lowercase hex digits')
end
if not name_ok(job) then return redis.error_reply('ERR_ARG job: invalid job name') end
if not hex_ok(sig, RULES.SIG_HEX) then
  return redis.error_reply('ERR_ARG sig: must be 16 lowercase hex digits')
end
if #path < 1 or #path > 1024 then return redis.error_reply('ERR_ARG path: must be 1..1024 bytes') end
if not hex_ok(fsum, RULES.FILE_SUM_HEX) then
  return redis.error_reply('ERR_ARG sum: must be 40 lowercase hex digits')
end
if not int_in(n, 1, RULES.MAX_CALL_ITEMS) then
  return redis.error_reply('ERR_ARG argv: 8 arguments and 1..' .. RULES.MAX_CALL_ITEMS .. ' (id, sum) pairs expected')
end
local max_tok = RULES.MAX_INPUT_TOKENS
if not int_in(tokens, n, n * max_tok) or not int_in(lmin, 1, max_tok) or not int_in(lmax, lmin, max_tok) then
  return redis.error_reply('ERR_ARG tokens: tokens, lmin and lmax must be whole numbers, lmin <= lmax')
end
local packed_key = base .. ':job:' .. job .. ':packed'
local ids, sums = {}, {}
for i = 1, n do
  local id, sum = ARGV[7 + 2 * i], ARGV[8 + 2 * i]
  if #id < 1 or #id > RULES.MAX_ID_BYTES then
    return redis.error_reply('ERR_ARG id: must be 1..' .. RULES.MAX_ID_BYTES .. ' bytes at item ' .. (i - 1))
  end
  if not hex_ok(sum, RULES.SUM_HEX) then
    return redis.error_reply('ERR_ARG sum: must be 16 lowercase hex digits at item ' .. (i - 1))
  end
  ids[i], sums[i] = id, sum
end

-- the job's class names the shape key the items will count in (submit.lua places them there): read
-- first, so that the check below names that key, not the plain signature's
local refused = acl_refused(function(ok) return ok('HMGET', job_key) end)
if refused then return refused end
local shape = qualified(job_class(base, job), sig)
refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('ZSCORE', segs_key) and ok('HMGET', sums_key)
    and ok('HINCRBY', job_key) and ok('HINCRBY', intake_key) and ok('ZADD', segs_key) and ok('HSET', seg_key)
    and ok('TIME') and ok('HGET', packed_key) and ok('HMGET', packed_key) and ok('HMGET', job_key)
    and ok('HGET', stored_key) and ok('HMGET', stored_key) and ok('HSET', stored_key) and ok('HINCRBY', stored_key)
    and ok('RPUSH', ids_key) and ok('HINCRBY', base .. ':shape:' .. shape) and ok('HSET', base .. ':shape:' .. shape)
    and ok('ZADD', base .. ':shape:' .. shape .. ':segs')
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
if redis.call('ZSCORE', segs_key, name) then return 0 end

local known, seen = {}, {}
for s = 1, n, 2000 do
  local part = redis.call('HMGET', sums_key, unpack(ids, s, math.min(s + 1999, n)))
  for j = 1, #part do known[s + j - 1] = part[j] end
end
local want = {}
for i = 1, n do
  if not known[i] then want[#want + 1] = i end
end
local packed = packed_sums(packed_key, ids, want)
local fresh = {}
for i = 1, n do
  if not known[i] and not packed[i] then fresh[#fresh + 1] = i end
end
-- the stored ids' buckets of every id not known elsewhere: the lookup, and what the append extends
local stored = packed_view(stored_key, ids, fresh)
local conflicts, dups = 0, 0
for i = 1, n do
  local had, sum = known[i], sums[i]
  had = had or packed[i] or stored.sums[i]
  if seen[ids[i]] then return redis.error_reply('ERR_ARG id: ' .. ids[i] .. ' twice in one segment') end
  seen[ids[i]] = true
  if had then
    -- '-' (an id registered before sums were kept) cannot be judged
    if had == '-' or had == sum then dups = dups + 1 else conflicts = conflicts + 1 end
  end
end
if conflicts > 0 then
  return redis.error_reply('CONFLICT ' .. conflicts .. ' ids of this segment are ids job ' .. job ..
    ' already has with other content')
end
if dups > 0 then
  return redis.error_reply('KNOWN ' .. dups .. ' ids of this segment are in job ' .. job .. ' already')
end

-- a new stored-ids hash gets buckets for the job's size: declared (a file's intake declares it
-- first) or what it has submitted with this segment
local jc = redis.call('HMGET', job_key, 'declared', 'submitted')
local k_new = packed_digits(math.max(num(jc[1]), num(jc[2]) + n))

local seq = redis.call('HINCRBY', intake_key, 'seg_seq', 1)
packed_append(stored, k_new, fresh, sums)
for s = 1, n, 2000 do redis.call('RPUSH', ids_key, unpack(ids, s, math.min(s + 1999, n))) end
redis.call('HINCRBY', job_key, 'submitted', n)
redis.call('HINCRBY', job_key, 'submitted_tokens', tokens)
redis.call('HINCRBY', intake_key, 'stored_tokens', tokens)
redis.call('HINCRBY', intake_key, 'stored_items', n)
shape_stored_add(base, shape, tokens)
redis.call('HINCRBY', intake_key, 'submitted', n)
redis.call('ZADD', segs_key, seq, name)
redis.call('ZADD', base .. ':shape:' .. shape .. ':segs', seq, name)
redis.call('HSET', seg_key, 'job', job, 'sig', sig, 'path', path, 'sum', fsum, 'items', n, 'tokens', tokens,
  'lmin', lmin, 'lmax', lmax, 'seq', seq, 'created_ms', now_ms(), 'shape', shape)
return 1
