-- lib_requeue.lua: give one pending batch back to the reclaimed queue, inlined by reclaim.lua
-- and fail.lua. Expects locals base, state_key, batches_key, reclaimed_key, cfg, now.
-- Items that already have a result are dropped (effectively-once); items delivered 3 or more
-- times travel alone, so one poison item cannot take its batch down again. Blame: an item
-- goes to the dead letter (with its reason and a failed result) once delivered max_deliveries
-- times when the batch is blamed for the failure (the engine failed it, or it was the last
-- batch a dead consumer took: a crash at admission), and only after twice that many otherwise,
-- so innocent items that shared a dying worker with a poison item are not dead-lettered with it.

local function dead_letter(it, b, bid, reason)
  local model = string.match(base, '{(.*)}')
  local jk = base .. ':job:' .. it[2]
  redis.call('HSET', jk .. ':items', it[1], 'd')
  local rec = cjson.encode({id = it[1], model = model, job = it[2], output = '', output_tokens = 0,
    error = {code = 'dead_letter', message = 'delivered ' .. it[6] .. ' times; last: ' .. reason},
    shape = b[1], epoch = b[2], lane = b[3], batch = bid, batch_size = #b[8], batch_padded_len = b[4],
    input_tokens = it[3], worker = '', claimed_at = b[6], finished_at = now, deliveries = it[6]})
  -- The failed result's id rides with the dead entry, so dead_retry.lua can take it back and the
  -- job never holds two results for one item.
  local rid = redis.call('XADD', jk .. ':results', '*', 'id', it[1], 'r', rec)
  redis.call('XADD', base .. ':dead', '*', 'id', it[1], 'job', it[2], 'deliveries', it[6],
    'error', reason, 'sig', b[1], 'ep', b[2], 'lane', b[3], 'tok', it[3], 'mt', it[4], 'd', it[5],
    'batch', bid, 'rid', rid, 'ms', now)
  redis.call('HINCRBY', jk, 'failed', 1)
  redis.call('HINCRBY', state_key, 'failed', 1)
  redis.call('HINCRBY', state_key, 'dead_lettered', 1)
end

-- Returns requeued items, dead-lettered items; 0, 0 when the batch was no longer pending.
local function requeue(bid, reason, blamed)
  local entry = redis.call('XRANGE', batches_key, bid, bid)[1]
  if redis.call('XACK', batches_key, 'workers', bid) == 0 then return 0, 0 end
  redis.call('XDEL', batches_key, bid)
  redis.call('HINCRBY', state_key, 'inflight_batches', -1)
  if not entry then return 0, 0 end
  local blob, n = nil, 0
  local f = entry[2]
  for j = 1, #f, 2 do
    if f[j] == 'b' then blob = f[j + 1] elseif f[j] == 'n' then n = tonumber(f[j + 1]) end
  end
  redis.call('HINCRBY', state_key, 'inflight_items', -n)
  local b = cmsgpack.unpack(blob)
  local keep, dead, alone = {}, 0, false
  local limit = blamed and cfg.max_deliveries or 2 * cfg.max_deliveries
  for _, it in ipairs(b[8]) do
    if redis.call('HGET', base .. ':job:' .. it[2] .. ':items', it[1]) == 'q' then
      if it[6] >= limit then
        dead_letter(it, b, bid, reason)
        dead = dead + 1
      else
        it[6] = it[6] + 1
        if it[6] >= 3 then alone = true end
        keep[#keep + 1] = it
      end
    end
  end
  if #keep > 0 then
    if alone then
      for _, it in ipairs(keep) do
        b[8] = {it}
        redis.call('RPUSH', reclaimed_key, cmsgpack.pack(b))
      end
    else
      b[8] = keep
      redis.call('RPUSH', reclaimed_key, cmsgpack.pack(b))
    end
    redis.call('HINCRBY', state_key, 'reclaimed_items', #keep)
    redis.call('HINCRBY', state_key, 'requeued_items', #keep)
  end
  return #keep, dead
end
