#!lua flags=allow-oom
-- allow-oom: the items leave another shard of the same Redis Cluster in the same step (a migration
-- moves memory, it does not add work); refusing here would strand them in the old shard's moving list.
-- hand_in.lua: items an old shard of a model handed over (lua/hand_over.lua) after they had been
-- delivered there and given back (reclaimed or failed: the batch came from the old shard's reclaimed
-- queue), taken in by their new shard with their delivery count (issue 36). submit.lua would put them
-- in a lane, where the next claim counts them delivered once: a change of S would then reset the
-- count that the dead letter (max_deliveries, lib_requeue.lua) is judged on. Here they join the new
-- shard's reclaimed queue (served first) carrying that count, and the new shard's registries and
-- submitted counts as submit.lua would write them (the old shard's were taken back by hand_over.lua).
--
-- KEYS[1] base       cdr:{shard}            (the new shard)
-- KEYS[2] cfg        cdr:{shard}:cfg
-- KEYS[3] state      cdr:{shard}:state
-- KEYS[4] reclaimed  cdr:{shard}:reclaimed
-- ARGV[1] n          number of items that follow (1..5000)
-- ARGV[2] job        the job every item of the call belongs to
-- ARGV[3..2+3n]      submit.lua's 3 fields per item: sig, record, prefix; one signature for the call
-- ARGV[3+3n]         the items' content sums (submit.lua's, required here)
-- ARGV[4+3n]         deliveries: the count the items' next claim gives them (the old shard's batch
--                    entry dv, 2..1000000: 1 is a first delivery, which submit.lua gives)
-- Returns: the number of items taken in; an id the job already has here with the same content is
--   skipped (a migration step re-run after it died between this call and deleting its moving list).
--   Errors, with nothing written: 'ERR_ARG <field>: ...'; 'CONFLICT <n> ...' as submit.lua;
--   'ERR_STATE ...' when an id waits in a store segment of this shard; 'NOPERM ...' (lib.lua
--   acl_refused); 'PAUSED ...'.
-- Invariant: an item is claimable in one place at any time (the old shard's copy sits in its moving
--   list, read by nothing but the migration); its delivery count never goes down on a move; every
--   check and read comes before the first write.
--@include lib.lua
--@include lib_submit_args.lua
--@include lib_packed.lua
--@include lib_job_ids.lua
--@include lib_intake.lua

local base, cfg_key, state_key, reclaimed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = tonumber(ARGV[1])
if not int_in(n, 1, RULES.MAX_CALL_ITEMS) then
  return redis.error_reply('ERR_ARG n: item count must be an integer in 1..' .. RULES.MAX_CALL_ITEMS)
end
if #ARGV ~= 4 + 3 * n then
  return redis.error_reply('ERR_ARG argv: expected ' .. (4 + 3 * n) .. ' arguments, got ' .. #ARGV)
end
local sums, dv = ARGV[3 + 3 * n], tonumber(ARGV[4 + 3 * n])
if #sums ~= RULES.SUM_HEX * n or not string.match(sums, '^[0-9a-f]*$') then
  return redis.error_reply('ERR_ARG sums: must be 16 lowercase hex digits per item, ' .. 16 * n .. ' in all')
end
if not int_in(dv, 2, 1000000) then
  return redis.error_reply('ERR_ARG deliveries: must be an integer in 2..1000000')
end
local job = ARGV[2]
if not name_ok(job) then return redis.error_reply('ERR_ARG job: invalid job name') end
local call, err = check_items(ARGV, n, job)
if not call then return err end
local sig = ARGV[3]
for i = 1, n - 1 do
  if ARGV[3 + 3 * i] ~= sig then
    return redis.error_reply('ERR_ARG sig: one signature per call (a moved batch is one shape), item ' .. i ..
      ' differs')
  end
end
err = prefixes_missing(base, call)
if err then return err end
local refused = acl_refused(function(ok)
  local ji = base .. ':in:' .. job
  return ok('HGET', state_key) and ok('HMGET', ji) and ok('HMGET', ji .. ':sums') and ok('HGET', ji .. ':stored')
    and ok('HMGET', ji .. ':stored') and ok('HGET', base .. ':job:0:packed') and ok('HMGET', base .. ':job:0:packed')
    and ok('HMGET', base .. ':job:0:items') and ok('HMGET', cfg_key) and ok('HGET', base .. ':shape:0')
    and ok('HEXISTS', base .. ':shape:0') and ok('HSETNX', base .. ':shape:0') and ok('HSET', ji .. ':sums')
    and ok('HINCRBY', ji)
    and ok('HINCRBY', base .. ':intake') and ok('HINCRBY', state_key) and ok('RPUSH', reclaimed_key)
    and ok('LPUSH', base .. ':bell') and ok('LTRIM', base .. ':bell')
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
local cfg = load_cfg(cfg_key)
local class = job_class(base, job)
local qsig = qualified(class, sig)

-- reads: the job's registry here (idempotent on id, as submit.lua)
local known, fresh_sums, conflicts, from_store =
  id_conflicts(base .. ':in:' .. job .. ':sums', base .. ':job:' .. job .. ':items', base .. ':in:' .. job .. ':stored',
    ARGV, call.ids, n, sums)
if conflicts > 0 then
  return redis.error_reply('CONFLICT ' .. conflicts .. ' ids of this call are ids job ' .. job ..
    ' already has with other content')
end
for i = 1, n do
  if from_store[i] then
    return redis.error_reply('ERR_STATE item ' .. call.ids[i] .. ' of job ' .. job .. ' waits in a store segment ' ..
      'of this shard: it cannot be handed in too')
  end
end
local recs, toks, seen, tokens = {}, {}, {}, 0
for i = 1, n do
  local id = call.ids[i]
  if not known[i] and not seen[id] then
    seen[id] = true
    recs[#recs + 1] = ARGV[4 + 3 * (i - 1)]
    toks[#toks + 1] = call.toks[i]
    tokens = tokens + call.toks[i]
  end
end
if #recs == 0 then return 0 end
local prefix = call.prefixes[sig] or redis.call('HGET', base .. ':shape:' .. sig, 'prefix')

-- writes: the prefix where workers read it (the qualified signature's, as submit.lua), the registry
-- and counts, then the reclaimed entries (msgpack [sig, epoch, lane, deliveries, tokens, records],
-- lib_requeue.lua; epoch and lane 0: the items joined no lane here, and a reclaimed entry's are
-- only reported). Items delivered 3 or more times travel alone, as lib_requeue.lua sends them.
redis.call('HSETNX', base .. ':shape:' .. sig, 'prefix', prefix)
if qsig ~= sig then redis.call('HSETNX', base .. ':shape:' .. qsig, 'prefix', prefix) end
hset_pairs(base .. ':in:' .. job .. ':sums', fresh_sums)
redis.call('HINCRBY', base .. ':in:' .. job, 'submitted', #recs)
redis.call('HINCRBY', base .. ':in:' .. job, 'submitted_tokens', tokens)
redis.call('HINCRBY', base .. ':intake', 'submitted', #recs)
if dv >= 3 then
  for i = 1, #recs do
    redis.call('RPUSH', reclaimed_key, cmsgpack.pack({qsig, 0, 0, dv, {toks[i]}, {recs[i]}}))
  end
else
  redis.call('RPUSH', reclaimed_key, cmsgpack.pack({qsig, 0, 0, dv, toks, recs}))
end
redis.call('HINCRBY', state_key, 'reclaimed_items', #recs)
ring_doorbell(base, cfg, tokens, #recs)
return #recs
