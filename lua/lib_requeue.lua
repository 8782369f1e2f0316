-- lib_requeue.lua: give one pending batch back to the reclaimed queue, inlined by reclaim.lua
-- and fail.lua (through lib_requeue_prologue.lua). Every function takes rq, the requeue context
-- lib_requeue_prologue.lua builds: base, state_key, batches_key, reclaimed_key, cfg, now.
-- Keys: M:batches (XRANGE, XACK, XDEL), M:bat:<token>, M:job:J:items/results and M:job:J,
--   M:dead, M:reclaimed, M:state counters; M:in:J (HMGET) for the end stamp.
-- A pending batch is its batches-stream entry (fields in conductor/redis_contract/keys.py) plus the list of its
-- item records named by the entry's token; a requeued batch becomes one reclaimed entry, msgpack
-- [sig, epoch, lane, deliveries, tokens, records]. Item records travel as they are (their bytes
-- are never rebuilt), and all items of a batch share one delivery count.
-- Invariants: items that already have a result are dropped (effectively-once); items delivered 3 or more
-- times travel alone, so one poison item cannot take its batch down again. Blame: an item
-- goes to the dead letter (with its reason and a failed result) once delivered max_deliveries
-- times when the batch is blamed for the failure (the engine failed it, or it was the last
-- batch a dead consumer took: a crash at admission), and only after twice that many otherwise,
-- so innocent items that shared a dying worker with a poison item are not dead-lettered with it.
-- Two steps, so that a script reads and decodes every batch it gives back before its first
-- write: requeue_plan (reads only) and requeue_apply (writes only). A dead letter that answers a
-- job's last item stamps the job's end (lib_job_end.lua), as a completion would.
--@include lib.lua
--@include lib_packed.lua
--@include lib_job_end.lua

-- The commands requeue_plan and requeue_apply may call, as checks for lib.lua acl_refused; job
-- keys by one name of their pattern.
local function requeue_acl(rq, ok)
  local base, state_key, batches_key, reclaimed_key = rq.base, rq.state_key, rq.batches_key, rq.reclaimed_key
  local jk = base .. ':job:0'
  return ok('HINCRBY', state_key) and ok('XRANGE', batches_key) and ok('XACK', batches_key)
    and ok('XDEL', batches_key) and ok('LRANGE', base .. ':bat:0') and ok('DEL', base .. ':bat:0')
    and ok('HGET', jk .. ':items') and ok('HGET', jk .. ':packed') and ok('HMGET', jk .. ':packed')
    and ok('HSET', jk .. ':items') and ok('XADD', jk .. ':results')
    and ok('HINCRBY', jk) and ok('XADD', base .. ':dead') and ok('RPUSH', reclaimed_key)
    and job_end_ok(ok, base, '0')
end

-- One pending batch read and decided, nothing written: a plan for requeue_apply, or nil and the
-- error reply to return when one of its item records does not decode (a human must look).
local function requeue_plan(rq, bid, reason, blamed)
  local base, batches_key, cfg, now = rq.base, rq.batches_key, rq.cfg, rq.now
  local entry = redis.call('XRANGE', batches_key, bid, bid)[1]
  local plan = {bid = bid, found = entry ~= nil, keep = {}, toks = {}, dead = {}, ends = {}}
  if not entry then return plan end
  local e = {}
  for j = 1, #entry[2], 2 do e[entry[2][j]] = entry[2][j + 1] end
  plan.n = num(e.n)
  plan.items_key = base .. ':bat:' .. (e.k or '')
  plan.sig, plan.ep, plan.lane = e.sig or '', tonumber(e.ep) or 0, tonumber(e.lane) or 0
  local dv = num(e.dv)
  plan.dv = dv
  local limit = blamed and cfg.max_deliveries or 2 * cfg.max_deliveries
  local model = string.match(base, '{(.*)}')
  for _, rec in ipairs(redis.call('LRANGE', plan.items_key, 0, -1)) do
    local ok, it = pcall(cjson.decode, rec)
    if not ok or type(it) ~= 'table' or type(it[1]) ~= 'string' or type(it[2]) ~= 'string'
        or type(it[3]) ~= 'number' then
      return nil, redis.error_reply('ERR_STATE ' .. plan.items_key .. ' holds an item record that does not ' ..
        'decode as [id, job, input_tokens, ...]: nothing written')
    end
    local jk = base .. ':job:' .. it[2]
    if not item_done(jk, it[1]) then  -- a done mark, or packed (lib_packed.lua)
      if dv >= limit then
        -- The failed result (lib_generated.lua result_record) and the dead-letter entry.
        local res = result_record({id = it[1], model = model, job = it[2],
          error = {code = 'dead_letter', message = 'delivered ' .. dv .. ' times; last: ' .. reason},
          shape = e.sig, epoch = tonumber(e.ep), lane = tonumber(e.lane), batch = bid,
          batch_size = tonumber(e.n), batch_padded_len = tonumber(e.plen), input_tokens = it[3],
          worker = e.w, claimed_at = tonumber(e.ts), finished_at = now, deliveries = dv})
        if not plan.ends[it[2]] then plan.ends[it[2]] = job_end_read(base, it[2]) end
        plan.dead[#plan.dead + 1] = {jk = jk, job = it[2], id = it[1], res = res,
          fields = {'id', it[1], 'job', it[2], 'deliveries', dv, 'error', reason, 'sig', e.sig or '',
            'ep', e.ep or '', 'lane', e.lane or '', 'tok', it[3], 'mt', tostring(it[4]), 'it', rec,
            'batch', bid}}
      else
        plan.keep[#plan.keep + 1] = rec
        plan.toks[#plan.toks + 1] = it[3]
      end
    end
  end
  return plan
end

-- The plan written: returns requeued items, dead-lettered items; 0, 0 when the batch was no
-- longer pending.
local function requeue_apply(rq, plan)
  local base, state_key, batches_key, reclaimed_key = rq.base, rq.state_key, rq.batches_key, rq.reclaimed_key
  local now = rq.now
  if redis.call('XACK', batches_key, GROUP, plan.bid) == 0 then return 0, 0 end
  redis.call('XDEL', batches_key, plan.bid)
  redis.call('HINCRBY', state_key, 'inflight_batches', -1)
  if not plan.found then return 0, 0 end
  redis.call('HINCRBY', state_key, 'inflight_items', -plan.n)
  redis.call('DEL', plan.items_key)
  local added = {}
  for _, d in ipairs(plan.dead) do
    added[d.job] = (added[d.job] or 0) + 1
    redis.call('HSET', d.jk .. ':items', d.id, 'd')
    -- The failed result's id rides with the dead entry, so dead_retry.lua can take it back and
    -- the job never holds two results for one item.
    local rid = redis.call('XADD', d.jk .. ':results', '*', 'id', d.id, 'r', d.res)
    local f = d.fields
    f[#f + 1] = 'rid'
    f[#f + 1] = rid
    f[#f + 1] = 'ms'
    f[#f + 1] = now
    redis.call('XADD', base .. ':dead', '*', unpack(f))
    redis.call('HINCRBY', d.jk, 'failed', 1)
    redis.call('HINCRBY', state_key, 'failed', 1)
    redis.call('HINCRBY', state_key, 'dead_lettered', 1)
  end
  for job, n in pairs(added) do job_end_stamp(base, job, plan.ends[job], n, now) end
  local keep, toks = plan.keep, plan.toks
  if #keep > 0 then
    local sig, ep, lane, dv = plan.sig, plan.ep, plan.lane, plan.dv
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
  return #keep, #plan.dead
end
