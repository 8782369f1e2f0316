#!lua flags=allow-oom
-- allow-oom: a migration frees this shard's memory (the items move to another slot).
-- hand_over.lua: a batch claimed on an old shard of a model whose shard count changed (issue 36;
-- conductor/client/shard_migrate.py) taken out of that shard whole: its items leave the shard's
-- in-flight counts, its jobs' id registries and submitted counts, and wait in a moving list of
-- the same slot until the client has submitted them to their new shard and deleted the list
-- (cdr:{shard}:moving names each such list with the batch's shape signature and, for a batch
-- delivered before (taken from the reclaimed queue, its entry's dv above 1), 'sig:dv': the items'
-- next delivery count, which lua/hand_in.lua carries to the new shard so that a change of S never
-- resets the count the dead letter is judged on).
--
-- KEYS[1] base     cdr:{shard}
-- KEYS[2] state    cdr:{shard}:state
-- KEYS[3] batches  cdr:{shard}:batches   (group "workers")
-- ARGV[1] batch_id   the pending batch claim.lua made
-- ARGV[2] consumer   who claimed it (must own it)
-- ARGV[3] token      the batch's k: its items are cdr:{shard}:bat:<k>, they move to cdr:{shard}:moving:<k>
-- Returns: the number of items handed over; 0, with nothing written, when the batch is not pending
--   for this consumer (completed, failed or reclaimed meanwhile).
--   Errors, with nothing written: 'ERR_ARG <field>: ...'; 'ERR_STATE ...' when the entry does not
--   name this token, an item record does not decode, or an item has a result already or is in no
--   job registry of this shard; 'NOPERM ...' (lib.lua acl_refused); 'PAUSED ...'.
-- Invariant: an item is claimable in one place at any time: it leaves this shard's stream entry,
--   in-flight counts, registry and submitted counts in this one step, and the moving list is read
--   by nothing but the migration, which submits it to the new shard (idempotent on id there)
--   before it deletes the list. Every check and read comes before the first write.
--@include lib.lua

local base, state_key, batches_key = KEYS[1], KEYS[2], KEYS[3]
local bid, consumer, token = ARGV[1], ARGV[2], ARGV[3]
local bad = batch_ref_bad(bid, consumer)
if bad then return bad end
if not token_ok(token) then return redis.error_reply('ERR_ARG token: not a batch token') end
local stop = paused(state_key)
if stop then return stop end

-- reads: the entry, pending for this consumer and naming this token; the items; each item's job
local p = redis.call('XPENDING', batches_key, GROUP, bid, bid, 1, consumer)
if #p == 0 then return 0 end
local entry = redis.call('XRANGE', batches_key, bid, bid)
local k, sig, dv
if entry[1] then
  local f = entry[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'k' then k = f[i + 1] elseif f[i] == 'sig' then sig = f[i + 1] elseif f[i] == 'dv' then dv = f[i + 1] end
  end
end
if k ~= token or not sig then
  return redis.error_reply('ERR_STATE the batch entry does not name token ' .. token .. ' and a shape')
end
local items_key, moving_key = base .. ':bat:' .. token, base .. ':moving:' .. token
local recs = redis.call('LRANGE', items_key, 0, -1)
local by_job, order, tokens_of = {}, {}, {}
for _, rec in ipairs(recs) do
  local ok, it = pcall(cjson.decode, rec)
  if not ok or type(it) ~= 'table' or type(it[1]) ~= 'string' or type(it[2]) ~= 'string' then
    return redis.error_reply('ERR_STATE an item record of the batch does not decode')
  end
  local id, job = it[1], it[2]
  if not by_job[job] then by_job[job] = {}; order[#order + 1] = job; tokens_of[job] = 0 end
  local ids = by_job[job]
  ids[#ids + 1] = id
  tokens_of[job] = tokens_of[job] + num(it[3])
end
for _, job in ipairs(order) do
  local sums, done = base .. ':in:' .. job .. ':sums', base .. ':job:' .. job .. ':items'
  for _, id in ipairs(by_job[job]) do
    if redis.call('HEXISTS', sums, id) == 0 then
      return redis.error_reply('ERR_STATE item ' .. id .. ' of job ' .. job .. ' is in no registry of this shard')
    end
    if redis.call('HEXISTS', done, id) == 1 then
      return redis.error_reply('ERR_STATE item ' .. id .. ' of job ' .. job .. ' has its result already')
    end
  end
end
local refused = acl_refused(function(ok)
  return ok('XACK', batches_key) and ok('XDEL', batches_key) and ok('HINCRBY', state_key)
    and ok('RENAME', items_key, moving_key) and ok('HSET', base .. ':moving') and ok('HDEL', base .. ':in:j:sums')
    and ok('HINCRBY', base .. ':in:j') and ok('HINCRBY', base .. ':intake')
end)
if refused then return refused end

-- writes
redis.call('XACK', batches_key, GROUP, bid)
redis.call('XDEL', batches_key, bid)
redis.call('HINCRBY', state_key, 'inflight_batches', -1)
redis.call('HINCRBY', state_key, 'inflight_items', -#recs)
if #recs > 0 then
  redis.call('RENAME', items_key, moving_key)
  local d = tonumber(dv) or 1
  redis.call('HSET', base .. ':moving', token, d > 1 and (sig .. ':' .. string.format('%d', d)) or sig)
end
for _, job in ipairs(order) do
  local ids = by_job[job]
  redis.call('HDEL', base .. ':in:' .. job .. ':sums', unpack(ids))
  redis.call('HINCRBY', base .. ':in:' .. job, 'submitted', -#ids)
  redis.call('HINCRBY', base .. ':in:' .. job, 'submitted_tokens', -tokens_of[job])
end
redis.call('HINCRBY', base .. ':intake', 'submitted', -#recs)
return #recs
