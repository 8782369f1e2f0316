#!lua flags=allow-oom
-- allow-oom: moving results out is how a full Redis gets memory back. The shebang also makes a
-- cluster node refuse any key outside the slot of the model's hash tag.
-- offload_results.lua: the oldest results of a job, written to a store segment by the lease
-- holder (conductor/tier/result_segments.py), leave the job's results stream in the same step as the
-- segment is registered, so a reader finds each result in exactly one of the two.
--
-- KEYS[1] results  cdr:{model}:job:J:results
-- KEYS[2] rsegs    cdr:{model}:job:J:rsegs    (list of segment records, oldest first)
-- KEYS[3] state    cdr:{model}:state          (read only: paused)
-- ARGV[1] record   the segment's record (JSON: path, first, last, n, sum), appended as is
-- ARGV[2..]        the stream ids the segment holds, oldest first, 1..5000: the oldest entries
--                  of the stream, in order
-- Returns: the number of entries moved out of the stream (all of ARGV[2..]), or 0 when the stream
--   does not begin with exactly these entries (another offload ran first: nothing written).
-- Errors, with nothing written: 'ERR_ARG ...'; 'NOPERM ...' (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: every result record of the job is in the stream or in one registered segment, never
--   both, never neither; segments are registered in stream order and never overlap.
--@include lib.lua

local results_key, rsegs_key, state_key = KEYS[1], KEYS[2], KEYS[3]
local record = ARGV[1]
local n = #ARGV - 1
if string.byte(record, 1) ~= 123 or #record > 4096 then
  return redis.error_reply('ERR_ARG record: must be a JSON object of at most 4096 bytes')
end
if not int_in(n, 1, RULES.MAX_CALL_ITEMS) then
  return redis.error_reply('ERR_ARG argv: 1..' .. RULES.MAX_CALL_ITEMS .. ' stream ids expected')
end
for i = 2, #ARGV do
  if not stream_id_ok(ARGV[i]) then return redis.error_reply('ERR_ARG id: not a stream id at ' .. (i - 2)) end
end
local refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('XRANGE', results_key) and ok('RPUSH', rsegs_key) and ok('XDEL', results_key)
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
local head = redis.call('XRANGE', results_key, '-', '+', 'COUNT', n)
if #head ~= n then return 0 end
for i = 1, n do
  if head[i][1] ~= ARGV[i + 1] then return 0 end
end
redis.call('RPUSH', rsegs_key, record)
for s = 2, #ARGV, 2000 do
  redis.call('XDEL', results_key, unpack(ARGV, s, math.min(s + 1999, #ARGV)))
end
return n
