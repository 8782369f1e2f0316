#!lua flags=allow-oom
-- allow-oom: at maxmemory a full Redis must still drain (this script frees or moves memory); only
-- submit.lua is refused, with QueueFull.
-- complete.lua: write results back idempotently and retire a finished batch.
--
-- KEYS[1] base     cdr:{model}
-- KEYS[2] state    cdr:{model}:state
-- KEYS[3] batches  cdr:{model}:batches   (group "workers")
-- ARGV[1] batch_id   the batches stream id the claim returned
-- ARGV[2] final      1 when this call carries the batch's last results (ack and delete it)
-- ARGV[3] n          number of results that follow
-- ARGV[4..]          4 fields per result: job, item id, status ('ok' | 'err'), result JSON
-- Retiring a batch acks and deletes its entry and deletes its items list (cdr:{model}:bat:<k>).
-- Returns: {written, acked}: results written now (a result already written before is skipped)
--   and 1 when this call retired the batch (0 when it was retired before, by this consumer or
--   by a reclaim). Errors: 'ERR_ARG <field>: ...' with nothing written.
-- Invariants: an item's result is written at most once (its state in the job's items hash
--   moves q -> d exactly once), so a batch completed twice, or completed by a slow worker after
--   a reclaim handed it to another, never duplicates a result; counters move with the writes.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua

local base, state_key, batches_key = KEYS[1], KEYS[2], KEYS[3]
local bid, final, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
if not bid or not string.match(bid, '^%d+%-%d+$') then
  return redis.error_reply('ERR_ARG batch_id: must be a stream id like 1700000000000-0')
end
if final ~= '0' and final ~= '1' then
  return redis.error_reply('ERR_ARG final: must be 0 or 1')
end
if not int_in(n, 0, 65536) then
  return redis.error_reply('ERR_ARG n: result count must be an integer in 0..65536')
end
if #ARGV ~= 3 + 4 * n then
  return redis.error_reply('ERR_ARG argv: expected ' .. (3 + 4 * n) .. ' arguments, got ' .. #ARGV)
end
for i = 0, n - 1 do
  local o = 4 + 4 * i
  local job = ARGV[o]
  if #job < 1 or #job > 128 or not string.match(job, '^[%w%._/@+=-]+$') then
    return redis.error_reply('ERR_ARG job: invalid job name at result ' .. i)
  end
  if #ARGV[o + 1] < 1 or #ARGV[o + 1] > 512 then
    return redis.error_reply('ERR_ARG id: must be 1..512 bytes at result ' .. i)
  end
  if ARGV[o + 2] ~= 'ok' and ARGV[o + 2] ~= 'err' then
    return redis.error_reply('ERR_ARG status: must be ok or err at result ' .. i)
  end
  -- 1,048,576 output tokens of a few bytes each fit; anything larger is a client bug.
  if #ARGV[o + 3] > 33554432 then
    return redis.error_reply('ERR_ARG result: larger than 33554432 bytes at result ' .. i)
  end
end

local refused = paused(state_key)
if refused then return refused end
local written, done_ok, done_err = 0, 0, 0
for i = 0, n - 1 do
  local o = 4 + 4 * i
  local job, id, status, rec = ARGV[o], ARGV[o + 1], ARGV[o + 2], ARGV[o + 3]
  local jk = base .. ':job:' .. job
  if redis.call('HGET', jk .. ':items', id) == 'q' then
    redis.call('HSET', jk .. ':items', id, 'd')
    redis.call('XADD', jk .. ':results', '*', 'id', id, 'r', rec)
    if status == 'ok' then
      redis.call('HINCRBY', jk, 'completed', 1)
      done_ok = done_ok + 1
    else
      redis.call('HINCRBY', jk, 'failed', 1)
      done_err = done_err + 1
    end
    written = written + 1
  end
end
if done_ok > 0 then redis.call('HINCRBY', state_key, 'completed', done_ok) end
if done_err > 0 then redis.call('HINCRBY', state_key, 'failed', done_err) end

local acked = 0
if final == '1' then
  local entry = redis.call('XRANGE', batches_key, bid, bid)[1]
  acked = redis.call('XACK', batches_key, 'workers', bid)
  if acked == 1 then
    redis.call('XDEL', batches_key, bid)
    redis.call('HINCRBY', state_key, 'inflight_batches', -1)
    local items = 0
    if entry then
      local f = entry[2]
      for j = 1, #f, 2 do
        if f[j] == 'n' then items = tonumber(f[j + 1])
        elseif f[j] == 'k' then redis.call('DEL', base .. ':bat:' .. f[j + 1]) end
      end
    end
    redis.call('HINCRBY', state_key, 'inflight_items', -items)
  end
end
return {written, acked}
