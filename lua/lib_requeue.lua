-- lib_requeue.lua: give one pending batch back to the reclaimed queue, inlined by reclaim.lua
-- and fail.lua. Expects locals base, state_key, batches_key, reclaimed_key, cfg, now.
-- A pending batch is its batches-stream entry (fields in conductor/keys.py) plus the list of its
-- item records named by the entry's token; a requeued batch becomes one reclaimed entry, msgpack
-- [sig, epoch, lane, deliveries, tokens, records]. Item records travel as they are (their bytes
-- are never rebuilt), and all items of a batch share one delivery count.
-- Items that already have a result are dropped (effectively-once); items delivered 3 or more
-- times travel alone, so one poison item cannot take its batch down again. Blame: an item
-- goes to the dead letter (with its reason and a failed result) once delivered max_deliveries
-- times when the batch is blamed for the failure (the engine failed it, or it was the last
-- batch a dead consumer took: a crash at admission), and only after twice that many otherwise,
-- so innocent items that shared a dying worker with a poison item are not dead-lettered with it.

-- it: the decoded item record {id, job, input_tokens, max_tokens, ...}; rec: its JSON text.
local function dead_letter(it, rec, e, dv, bid, reason)
  local model = string.match(base, '{(.*)}')
  local jk = base .. ':job:' .. it[2]
  redis.call('HSET', jk .. ':items', it[1], 'd')
  local res = cjson.encode({id = it[1], model = model, job = it[2], output = '', output_tokens = 0,
    error = {code = 'dead_letter', message = 'delivered ' .. dv .. ' times; last: ' .. reason},
    shape = e.sig, epoch = tonumber(e.ep), lane = tonumber(e.lane), batch = bid, batch_size = tonumber(e.n),
    batch_padded_len = tonumber(e.plen), input_tokens = it[3], worker = e.w or '', claimed_at = tonumber(e.ts),
    finished_at = now, deliveries = dv})
  -- The failed result's id rides with the dead entry, so dead_retry.lua can take it back and the
  -- job never holds two results for one item.
  local rid = redis.call('XADD', jk .. ':results', '*', 'id', it[1], 'r', res)
  redis.call('XADD', base .. ':dead', '*', 'id', it[1], 'job', it[2], 'deliveries', dv,
    'error', reason, 'sig', e.sig, 'ep', e.ep, 'lane', e.lane, 'tok', it[3], 'mt', it[4], 'it', rec,
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
  local e = {}
  for j = 1, #entry[2], 2 do e[entry[2][j]] = entry[2][j + 1] end
  redis.call('HINCRBY', state_key, 'inflight_items', -num(e.n))
  local items_key = base .. ':bat:' .. (e.k or '')
  local recs = redis.call('LRANGE', items_key, 0, -1)
  redis.call('DEL', items_key)
  local dv = num(e.dv)
  local limit = blamed and cfg.max_deliveries or 2 * cfg.max_deliveries
  local toks, keep, dead = {}, {}, 0
  for _, rec in ipairs(recs) do
    local it = cjson.decode(rec)
    if redis.call('HGET', base .. ':job:' .. it[2] .. ':items', it[1]) == 'q' then
      if dv >= limit then
        dead_letter(it, rec, e, dv, bid, reason)
        dead = dead + 1
      else
        keep[#keep + 1] = rec
        toks[#toks + 1] = it[3]
      end
    end
  end
  if #keep > 0 then
    local sig, ep, lane = e.sig, tonumber(e.ep), tonumber(e.lane)
    if dv + 1 >= 3 then
      for i = 1, #keep do
        redis.call('RPUSH', reclaimed_key, cmsgpack.pack({sig, ep, lane, dv + 1, {toks[i]}, {keep[i]}}))
      end
    else
      redis.call('RPUSH', reclaimed_key, cmsgpack.pack({sig, ep, lane, dv + 1, toks, keep}))
    end
    redis.call('HINCRBY', state_key, 'reclaimed_items', #keep)
    redis.call('HINCRBY', state_key, 'requeued_items', #keep)
  end
  return #keep, dead
end
