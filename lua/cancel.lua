#!lua flags=allow-oom
-- allow-oom: cancelling frees work and must run on a full Redis, which drains.
-- cancel.lua: one bounded step of cancelling (or expiring) a job on one model (conductor cancel;
-- conductor/lifecycle.py). Each call walks at most about `count` entries of the job's id registry
-- from `cursor` (HSCAN) and gives every waiting item of them an error result; the caller loops until
-- the cursor comes back '0'. Items in flight (in a pending batch's items list) are left alone: their
-- batch finishes and its results are kept (complete.lua). The items stay in their lanes, answered;
-- lua/repair_items.lua ('done') then takes them out of the lanes (lifecycle.withdraw).
--
-- KEYS[1] base     cdr:{model}             (pending batches' items lists: base .. ':bat:' .. token)
-- KEYS[2] state    cdr:{model}:state
-- KEYS[3] batches  cdr:{model}:batches     (group "workers")
-- KEYS[4] job      the job's counters for this model (keys.py ModelKeys.job)
-- KEYS[5] items    the job's done marks (keys.py ModelKeys.job_items): id -> d
-- KEYS[6] results  the job's results stream (keys.py ModelKeys.job_results)
-- KEYS[7] registry the job's id registry (keys.py ModelKeys.job_sums): every id submitted
-- ARGV[1] job      the job name (written into each result)
-- ARGV[2] model    the model name (written into each result)
-- ARGV[3] cursor   HSCAN cursor ('0' to start), or 'lane:S:E:L': answer this job's waiting items of
--                  one lane cdr:{model}:lane:S:E:L instead (conductor/jobs/job_state.py walks the lanes
--                  first, so that those answers carry the item's input tokens and payload, which only
--                  its record holds; the registry pass then answers the rest, wherever they wait,
--                  with input_tokens 0 and payload null); or 'seg:N': answer the ids of store segment N
--                  (its list cdr:{model}:seg:N:ids; schema 6), which wait in no lane and no registry
--                  entry, with input_tokens 0 and payload null (the feeder then drops them unplaced)
-- ARGV[4] count    HSCAN COUNT, 1..10000
-- ARGV[5] code     the results' error code: 'cancelled' or 'expired'
-- ARGV[6] message  the results' error message, at most 1,000 bytes
-- Returns: {next cursor ('0' after a lane), items answered now, items skipped because in flight}.
-- The end stamp (lib_job_end.lua): every call sets 'ending' (the code) in the job's counters, so a
--   batch in flight that finishes later stamps the job with it; the call that answers the job's
--   last item stamps 'ended_ms' (now) and 'end' (the code) itself.
-- Errors, with nothing written: 'ERR_ARG <field>: ...'; 'NOPERM ...' when the caller's ACL refuses
--   a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: as complete.lua: an item gets its done mark at most once, together with one result
--   record and one count in the job's and the model's 'failed' counters (and in the job's counter
--   named by the code, 'cancelled' or 'expired': how many of its failed were answered so), so submitted = completed +
--   failed + pending holds after every call; an item in a pending batch is never answered here.
--   Every read (the pending batches and their items, the HSCAN page or the lane, the counters)
--   comes before the first write.
--@include lib.lua
--@include lib_job_end.lua

local base, state_key, batches_key, job_key, items_key, results_key, registry_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local job, model, cursor, count, code, message = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
if #ARGV ~= 6 then return redis.error_reply('ERR_ARG argv: expected 6 arguments, got ' .. #ARGV) end
if not name_ok(job) then
  return redis.error_reply('ERR_ARG job: invalid job name')
end
if not name_ok(model) then
  return redis.error_reply('ERR_ARG model: invalid model name')
end
local lane_key, seg_key = nil, nil
if cursor and string.sub(cursor, 1, 4) == 'seg:' then
  local sn = string.match(cursor, '^seg:(%x+)$')
  if not sn or #sn ~= 32 then return redis.error_reply('ERR_ARG cursor: a segment is "seg:N" (32 hex digits)') end
  seg_key = base .. ':seg:' .. sn
elseif cursor and string.sub(cursor, 1, 5) == 'lane:' then
  local sg, ep, ln = string.match(cursor, '^lane:(%x+):(%d+):(%d+)$')
  if not sg or #sg ~= 16 or #ep > 15 or #ln > 15 then
    return redis.error_reply('ERR_ARG cursor: a lane is "lane:S:E:L" (a signature, an epoch and a lane id)')
  end
  lane_key = base .. ':lane:' .. sg .. ':' .. ep .. ':' .. ln
elseif not cursor or #cursor > 20 or not string.match(cursor, '^%d+$') or not u64_ok(cursor) then
  return redis.error_reply('ERR_ARG cursor: must be an HSCAN cursor (a whole number below 2^64)')
end
if not int_in(count, 1, 10000) then return redis.error_reply('ERR_ARG count: must be an integer in 1..10000') end
if code ~= 'cancelled' and code ~= 'expired' then
  return redis.error_reply('ERR_ARG code: must be cancelled or expired')
end
if #message > 1000 then return redis.error_reply('ERR_ARG message: longer than 1000 bytes') end

local refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('HINCRBY', state_key) and ok('XPENDING', batches_key)
    and ok('XRANGE', batches_key) and ok('LRANGE', base .. ':bat:0') and ok('HSCAN', registry_key)
    and ok('HMGET', items_key) and ok('HSET', items_key) and ok('XADD', results_key) and ok('HINCRBY', job_key) and ok('TIME')
    and job_end_ok(ok, base, job) and (not lane_key or ok('LRANGE', lane_key))
    and (not seg_key or (ok('HGET', seg_key) and ok('LRANGE', seg_key .. ':ids')))
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

-- Items of this job in flight: every pending batch's items list (bounded by what is in flight,
-- never by the queue).
local inflight = {}
-- No group yet (no worker ever registered: submit leaves that to workers): nothing is in flight.
local pending = redis.pcall('XPENDING', batches_key, GROUP, '-', '+', 100000)
if type(pending) == 'table' and pending.err then
  if not string.find(pending.err, 'NOGROUP') then return pending end
  pending = {}
end
for _, p in ipairs(pending) do
  local entry = redis.call('XRANGE', batches_key, p[1], p[1])[1]
  local token = nil
  if entry then
    local f = entry[2]
    for j = 1, #f, 2 do
      if f[j] == 'k' then token = f[j + 1] end
    end
  end
  if token then
    for _, rec in ipairs(redis.call('LRANGE', base .. ':bat:' .. token, 0, -1)) do
      local id, rjob = string.match(rec, '^%["([^"\\]*)","([^"\\]*)",')
      if not id then
        local okd, d = pcall(cjson.decode, rec)
        if okd and type(d) == 'table' then id, rjob = d[1], d[2] end
      end
      if rjob == job and type(id) == 'string' then inflight[id] = true end
    end
  end
end

-- The end of the JSON string whose opening quote is at s[i]: the index of its closing quote.
local function string_end(str, i)
  local j = i + 1
  while true do
    local k = string.find(str, '["\\]', j)
    if not k then return nil end
    if string.byte(str, k) == 92 then j = k + 2 else return k end
  end
end

-- id, job, input tokens and the payload's JSON text of an item record (keys.py: [id, job,
-- input_tokens, max_tokens, prompt, payload]); the payload keeps the bytes its producer sent.
local function record_parts(rec)
  local id, rjob, tok, at = string.match(rec, '^%["([^"\\]*)","([^"\\]*)",(%d+),%d+,()"')
  local q = at and string_end(rec, at)
  local payload = q and string.match(rec, '^,(.*)%]$', q + 1)
  if payload then return id, rjob, tonumber(tok), payload end
  local okd, d = pcall(cjson.decode, rec)
  if not (okd and type(d) == 'table' and type(d[1]) == 'string') then return nil end
  local oke, p = pcall(cjson.encode, d[6])
  return d[1], d[2], tonumber(d[3]) or 0, (d[6] ~= nil and oke) and p or 'null'
end

local page, page_ids, recs = {'0'}, {}, {}
if lane_key then
  for _, rec in ipairs(redis.call('LRANGE', lane_key, 0, -1)) do
    local id, rjob, tok, payload = record_parts(rec)
    if rjob == job and id and not recs[id] then
      recs[id] = {tok, payload}
      page_ids[#page_ids + 1] = id
    end
  end
elseif seg_key then
  if redis.call('HGET', seg_key, 'job') == job then
    local once = {}
    for _, id in ipairs(redis.call('LRANGE', seg_key .. ':ids', 0, -1)) do
      if not once[id] then
        once[id] = true
        page_ids[#page_ids + 1] = id
      end
    end
  end
else
  page = redis.call('HSCAN', registry_key, cursor, 'COUNT', count)
  local flat = page[2]
  for j = 1, #flat, 2 do page_ids[#page_ids + 1] = flat[j] end
end
local ids, skipped = {}, 0
for s = 1, #page_ids, 2000 do
  local marks = redis.call('HMGET', items_key, unpack(page_ids, s, math.min(s + 1999, #page_ids)))
  for j = 1, #marks do
    local id = page_ids[s + j - 1]
    if marks[j] ~= 'd' then
      if inflight[id] then skipped = skipped + 1 else ids[#ids + 1] = id end
    end
  end
end

local ends = job_end_read(base, job)

-- The writes: one result, one done mark and one failed count per item, as complete.lua writes them
-- (kept in this one block so that a move of the worker-owned keys re-points it in one place).
local now = now_ms()
local res = {model = model, job = job, error = {code = code, message = message}, finished_at = now, deliveries = 0}
local marks = {}
for _, id in ipairs(ids) do
  local rec = recs[id] or {0, 'null'}
  res.id, res.input_tokens, res.payload = id, rec[1], rec[2]
  redis.call('XADD', results_key, '*', 'id', id, 'r', result_record(res))
  marks[#marks + 1] = id
  marks[#marks + 1] = 'd'
end
for s = 1, #marks, 2000 do
  redis.call('HSET', items_key, unpack(marks, s, math.min(s + 1999, #marks)))
end
if #ids > 0 then
  redis.call('HINCRBY', job_key, 'failed', #ids)
  redis.call('HINCRBY', job_key, code, #ids)  -- of them, answered by the end (conductor status's lines)
  redis.call('HINCRBY', state_key, 'failed', #ids)
end
redis.call('HSET', job_key, 'ending', code)
job_end_stamp(base, job, ends, #ids, now, code)
return {page[1], #ids, skipped}
