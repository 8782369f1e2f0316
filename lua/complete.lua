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
--   and 1 when this call retired the batch. {0, 0}, with nothing written, when the batch was
--   retired before (by this consumer, or by a reclaim that put its items back in the queue):
--   its items may be running elsewhere, so a late worker's results are not taken.
--   Errors, with nothing written: 'ERR_ARG <field>: ...' for a malformed argument, a batch id the
--   batches stream never issued, or a result for an item that is not in the batch (one still in a
--   lane, one of another batch); 'NOPERM ...' when the caller's ACL refuses a command this call may
--   run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariants: an item's result is written at most once (its state in the job's items hash
--   moves q -> d exactly once; an answered id compacted to M:job:J:packed counts as d), only while the item is in this pending batch's items list, so a
--   batch completed twice, or completed by a slow worker after a reclaim handed it on, never
--   duplicates a result and never marks done an item that waits elsewhere; counters move with the
--   writes. Every argument is checked, and the batch and its items are read, before the first write.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
-- Request jobs (a name starting 'rq.', conductor/request.py): each newly written result is also
--   pushed to cdr:{model}:reply:<job>:<id> (a list, expiring after 60 s) for the caller blocked on
--   it; written once with the result, so a re-delivered item answers its caller once. The call that
--   writes a job's last result stamps its end (lib_job_end.lua); a request job's never ends.
--@include lib.lua
--@include lib_batch_members.lua
--@include lib_job_end.lua
--@include lib_service.lua
--@include lib_packed.lua

local base, state_key, batches_key = KEYS[1], KEYS[2], KEYS[3]
local bid, final, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
if not stream_id_ok(bid) then
  return redis.error_reply('ERR_ARG batch_id: must be a stream id like 1700000000000-0 (two whole numbers below 2^64)')
end
if final ~= '0' and final ~= '1' then return redis.error_reply('ERR_ARG final: must be 0 or 1') end
if not int_in(n, 0, RULES.MAX_BATCH_ITEMS) then
  return redis.error_reply('ERR_ARG n: result count must be an integer in 0..' .. RULES.MAX_BATCH_ITEMS)
end
if #ARGV ~= 3 + 4 * n then
  return redis.error_reply('ERR_ARG argv: expected ' .. (3 + 4 * n) .. ' arguments, got ' .. #ARGV)
end
for i = 0, n - 1 do
  local o = 4 + 4 * i
  local job = ARGV[o]
  if not name_ok(job) then
    return redis.error_reply('ERR_ARG job: invalid job name at result ' .. i)
  end
  if #ARGV[o + 1] < 1 or #ARGV[o + 1] > RULES.MAX_ID_BYTES then
    return redis.error_reply('ERR_ARG id: must be 1..' .. RULES.MAX_ID_BYTES .. ' bytes at result ' .. i)
  end
  if ARGV[o + 2] ~= 'ok' and ARGV[o + 2] ~= 'err' then
    return redis.error_reply('ERR_ARG status: must be ok or err at result ' .. i)
  end
  -- 1,048,576 output tokens of a few bytes each fit; anything larger is a client bug.
  if #ARGV[o + 3] > 33554432 then
    return redis.error_reply('ERR_ARG result: larger than 33554432 bytes at result ' .. i)
  end
end

-- Every command this call may run, on the keys it may run it on, before the first write.
local refused = acl_refused(function(ok)
  if not (ok('HGET', state_key) and ok('HINCRBY', state_key) and ok('XRANGE', batches_key) and service_ok(ok, base)
      and ok('XPENDING', batches_key) and ok('XACK', batches_key) and ok('XDEL', batches_key)
      and ok('XINFO', 'STREAM', batches_key) and ok('LRANGE', base .. ':bat:0') and ok('DEL', base .. ':bat:0')) then
    return false
  end
  local seen = {}
  for i = 0, n - 1 do
    local job = ARGV[4 + 4 * i]
    if not seen[job] then
      seen[job] = true
      local jk = base .. ':job:' .. job
      if not (ok('HMGET', jk .. ':items') and ok('HSET', jk .. ':items') and ok('HMGET', jk .. ':packed') and ok('HGET', jk .. ':packed') and ok('XADD', jk .. ':results')
          and ok('HINCRBY', jk) and ok('HGET', base .. ':in:' .. job) and job_end_ok(ok, base, job)) then
        return false
      end
      if is_request(job) and not (ok('LPUSH', base .. ':reply:' .. job .. ':0') and ok('PEXPIRE', base .. ':reply:' .. job .. ':0')) then
        return false
      end
    end
  end
  return true
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

-- The batch and its items, read before any write.
local entry = redis.call('XRANGE', batches_key, bid, bid)[1]
if not entry then
  local info = redis.pcall('XINFO', 'STREAM', batches_key)
  local last = nil
  if type(info) == 'table' and not info.err then
    for j = 1, #info, 2 do
      if info[j] == 'last-generated-id' then last = info[j + 1] end
    end
  end
  if not last or id_cmp(bid, last) > 0 then
    return redis.error_reply('ERR_ARG batch_id: ' .. bid .. ' names no batch the batches stream ever issued')
  end
  return {0, 0}  -- retired before: nothing of a retired batch is written
end
local count, token = 0, nil
local f = entry[2]
for j = 1, #f, 2 do
  if f[j] == 'n' then count = tonumber(f[j + 1]) or 0
  elseif f[j] == 'k' then token = f[j + 1] end
end
local items_key = token and (base .. ':bat:' .. token)
-- Which (job, id) the batch holds (lib_batch_members.lua).
local members = items_key and batch_members(items_key) or {}
for i = 0, n - 1 do
  local o = 4 + 4 * i
  local job, id = ARGV[o], ARGV[o + 1]
  if not (members[job] and members[job][id]) then
    return redis.error_reply('ERR_ARG id: item ' .. string.sub(id, 1, 100) .. ' of job ' .. job ..
      ' is not in batch ' .. bid .. ' (result ' .. i .. '): nothing written')
  end
end

-- XACK below refuses a stream without the group (NOGROUP): that refusal comes here, before any write.
if final == '1' then redis.call('XPENDING', batches_key, GROUP, bid, bid, 1) end

-- Which results are new: one HMGET per job (in slices: unpack stops near 8,000 values), before
-- any write; then per job one HSET and one HINCRBY per status instead of a command per result.
local jobs, order = {}, {}
for i = 0, n - 1 do
  local o = 4 + 4 * i
  local g = jobs[ARGV[o]]
  if not g then
    g = {ids = {}, at = {}, state = {}}
    jobs[ARGV[o]] = g
    order[#order + 1] = ARGV[o]
  end
  g.ids[#g.ids + 1] = ARGV[o + 1]
  g.at[#g.at + 1] = o
end
for _, job in ipairs(order) do
  local g = jobs[job]
  g.state = done_marks(base .. ':job:' .. job, g.ids)  -- packed ids (lib_packed.lua) are done too
  if not is_request(job) then g.ends = job_end_read(base, job) end
end

local served = service_counter(base)  -- lib_service.lua
local written, done_ok, done_err = 0, 0, 0
for _, job in ipairs(order) do
  local g, jk = jobs[job], base .. ':job:' .. job
  local marks, seen, ok_n, err_n, last = {}, {}, 0, 0, nil
  for j, id in ipairs(g.ids) do
    if g.state[j] ~= 'd' and not seen[id] then
      seen[id] = true
      local o = g.at[j]
      marks[#marks + 1] = id
      marks[#marks + 1] = 'd'
      last = redis.call('XADD', jk .. ':results', '*', 'id', id, 'r', ARGV[o + 3])
      if is_request(job) then
        local rk = base .. ':reply:' .. job .. ':' .. id
        redis.call('LPUSH', rk, ARGV[o + 3])
        redis.call('PEXPIRE', rk, RULES.REPLY_TTL_MS)
      end
      if ARGV[o + 2] == 'ok' then ok_n = ok_n + 1 else err_n = err_n + 1 end
      add_tokens(g, ARGV[o + 3])
    end
  end
  for s = 1, #marks, 2000 do
    redis.call('HSET', jk .. ':items', unpack(marks, s, math.min(s + 1999, #marks)))
  end
  if ok_n > 0 then redis.call('HINCRBY', jk, 'completed', ok_n) end
  if err_n > 0 then redis.call('HINCRBY', jk, 'failed', err_n) end
  if ok_n + err_n > 0 then served(job, g.pin or 0, g.pout or 0) end
  if last and g.ends then job_end_stamp(base, job, g.ends, ok_n + err_n, string.match(last, '^%d+')) end
  written, done_ok, done_err = written + ok_n + err_n, done_ok + ok_n, done_err + err_n
end
if done_ok > 0 then redis.call('HINCRBY', state_key, 'completed', done_ok) end
if done_err > 0 then redis.call('HINCRBY', state_key, 'failed', done_err) end

local acked = 0
if final == '1' then
  acked = redis.call('XACK', batches_key, GROUP, bid)
  if acked == 1 then
    redis.call('XDEL', batches_key, bid)
    redis.call('HINCRBY', state_key, 'inflight_batches', -1)
    if items_key then redis.call('DEL', items_key) end
    redis.call('HINCRBY', state_key, 'inflight_items', -count)
  end
end
return {written, acked}
