-- lib_complete_guard.lua: what complete.lua checks and reads before its first write: its arguments
-- ('ERR_ARG'), every command it may run under the caller's ACL ('NOPERM', lib.lua acl_refused), and
-- the batch: retired before (nothing to write), never issued, or not holding a result's item.
-- Keys: M:batches (XRANGE, XINFO STREAM), M:bat:<token> (LRANGE, lib_batch_members.lua).
-- Invariant: reads only; a command added to complete.lua or lib_writeback.lua is added to
--   complete_refused too (tests/test_script_acl_atomicity.py denies each in turn).
--@include lib.lua
--@include lib_batch_members.lua
--@include lib_job_end.lua
--@include lib_service.lua

-- complete.lua's ARGV checked (its header): returns bid, final, n and the results' jobs (each once, in
-- the order they first appear); or nil and the error reply.
local function complete_args(argv)
  local bid, final, n = argv[1], argv[2], tonumber(argv[3])
  if not stream_id_ok(bid) then
    return nil, redis.error_reply('ERR_ARG batch_id: must be a stream id like 1700000000000-0 (two whole numbers ' ..
      'below 2^64)')
  end
  if final ~= '0' and final ~= '1' then return nil, redis.error_reply('ERR_ARG final: must be 0 or 1') end
  if not int_in(n, 0, RULES.MAX_BATCH_ITEMS) then
    return nil, redis.error_reply('ERR_ARG n: result count must be an integer in 0..' .. RULES.MAX_BATCH_ITEMS)
  end
  if #argv ~= 3 + 4 * n then
    return nil, redis.error_reply('ERR_ARG argv: expected ' .. (3 + 4 * n) .. ' arguments, got ' .. #argv)
  end
  -- A batch's results name one job or a few: each name is checked once (a pattern match per result
  -- cost about a microsecond each).
  local named, jobs = {}, {}
  local max_id = RULES.MAX_ID_BYTES  -- read once: the loop runs once per result
  for i = 0, n - 1 do
    local o = 4 + 4 * i
    local job = argv[o]
    if not named[job] then
      if not name_ok(job) then
        return nil, redis.error_reply('ERR_ARG job: invalid job name at result ' .. i)
      end
      named[job] = true
      jobs[#jobs + 1] = job
    end
    local id_len, status = #argv[o + 1], argv[o + 2]
    if id_len < 1 or id_len > max_id then
      return nil, redis.error_reply('ERR_ARG id: must be 1..' .. max_id .. ' bytes at result ' .. i)
    end
    if status ~= 'ok' and status ~= 'err' then
      return nil, redis.error_reply('ERR_ARG status: must be ok or err at result ' .. i)
    end
    -- 1,048,576 output tokens of a few bytes each fit; anything larger is a client bug.
    if #argv[o + 3] > 33554432 then
      return nil, redis.error_reply('ERR_ARG result: larger than 33554432 bytes at result ' .. i)
    end
  end
  return bid, final, n, jobs
end

-- The error reply when the caller's ACL refuses a command this call may run, or nil. jobs: the
-- results' jobs, each once (complete_args), not a pass over every result.
local function complete_refused(base, state_key, batches_key, jobs)
  return acl_refused(function(ok)
    if not (ok('HGET', state_key) and ok('HINCRBY', state_key) and ok('XRANGE', batches_key) and service_ok(ok, base)
        and output_ratio_ok(ok, base)
        and ok('XPENDING', batches_key) and ok('XACK', batches_key) and ok('XDEL', batches_key)
        and ok('XINFO', 'STREAM', batches_key) and ok('LRANGE', base .. ':bat:0') and ok('DEL', base .. ':bat:0')) then
      return false
    end
    for _, job in ipairs(jobs) do
      local jk = base .. ':job:' .. job
      if not (ok('HMGET', jk .. ':items') and ok('HSET', jk .. ':items') and ok('HMGET', jk .. ':packed')
          and ok('HGET', jk .. ':packed') and ok('XADD', jk .. ':results') and ok('HINCRBY', jk)
          and ok('HGET', base .. ':in:' .. job) and job_end_ok(ok, base, job)) then
        return false
      end
      local rk = base .. ':reply:' .. job .. ':0'
      if is_request(job) and not (ok('LPUSH', rk) and ok('PEXPIRE', rk)) then
        return false
      end
    end
    return true
  end)
end

-- The batch bid as the batches stream holds it: its item count and items list, and which (job, id)
-- the list holds; every result's item must be one of them. Returns count, items_key and what its claim
-- charged (fields tn and vl: lib_fair.lua charge; empty for a reclaimed batch); or nil and the
-- reply to return ({0, 0} for a batch retired before, an error reply otherwise).
local function complete_batch(base, batches_key, bid, argv, n)
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
      return nil, redis.error_reply('ERR_ARG batch_id: ' .. bid .. ' names no batch the batches stream ever issued')
    end
    return nil, {0, 0}  -- retired before: nothing of a retired batch is written
  end
  local count, token, charged = 0, nil, {}
  local f = entry[2]
  for j = 1, #f, 2 do
    if f[j] == 'n' then count = tonumber(f[j + 1]) or 0
    elseif f[j] == 'k' then token = f[j + 1]
    elseif f[j] == 'tn' or f[j] == 'vl' then charged[f[j]] = f[j + 1] end
  end
  local items_key = token and (base .. ':bat:' .. token)
  -- Which (job, id) the batch holds (lib_batch_members.lua).
  local members = items_key and batch_members(items_key) or {}
  for i = 0, n - 1 do
    local o = 4 + 4 * i
    local job, id = argv[o], argv[o + 1]
    if not (members[job] and members[job][id]) then
      return nil, redis.error_reply('ERR_ARG id: item ' .. string.sub(id, 1, 100) .. ' of job ' .. job ..
        ' is not in batch ' .. bid .. ' (result ' .. i .. '): nothing written')
    end
  end
  return count, items_key, charged
end
