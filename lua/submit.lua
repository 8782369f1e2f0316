#!lua
-- The shebang (no flags) makes Redis 7 refuse this script at maxmemory before it runs and, on a
-- cluster node, refuse any key outside the slot of the model's hash tag.
-- submit.lua: append items to their shape's rolling lanes (seed 002), atomically.
--
-- KEYS[1] base    cdr:{model}            (per-shape, per-lane and per-job keys derive from it)
-- KEYS[2] cfg     cdr:{model}:cfg
-- KEYS[3] state   cdr:{model}:state   (read only: paused)
-- Writes only the producer's keys (deploy/redis/users.acl gives a producer nothing else):
--   M:intake (waiting tokens and items, submitted, last intake), M:in:J, M:in:J:sums and
--   M:in:J:stored (the job's declared and submitted counts, the id registry, the ids waiting in
--   the store), the shape, instance and lane keys.
-- ARGV[1] n       number of items that follow (1..5000)
-- ARGV[2] job     the job every item of the call belongs to
-- ARGV[3..]       3 fields per item: sig (16 hex), record, prefix (JSON list of at most 256
--                 strings, or '' when another item of this call carries it or the signature's
--                 prefix is stored already; a new signature's must come in the call). The record is the item
--                 as workers read it (conductor/redis_contract/keys.py): the JSON array
--                 [id, job, input_tokens, max_tokens, prompt, payload], first byte '[', in
--                 standard JSON: a form only cjson takes (NaN, hex, leading zeros) passes this
--                 check, and the worker answers that item with a bad_record error.
-- ARGV[3+3n]      optional: the items' content sums, 16 hex digits each, concatenated (the first 16
--                 of SHA-1(sig .. record), conductor/redis_contract/item_record.py content_sum): the
--                 producer's copy of what this script computes for a call without them (the SHA-1 was
--                 a quarter of submit.lua's server time per item, bench/RESULTS.md intake_speed).
-- Returns: one integer per item: the lane id it joined, or -1 when this job already has an
--   item with this id (an interrupted submit re-run neither loses nor duplicates). An id that
--   waits in a store segment (in M:in:J:stored, register_segment.lua) joins a lane
--   once, counted then as waiting instead of stored (the disk tier's feeder loads segments so); one
--   a cancel or an expiry answered while it waited in the store is not placed (answered -1) and
--   leaves the stored counters.
--   Errors, with nothing written: 'ERR_ARG <field>: ...' for a malformed argument,
--   'FULL ...' when the model's waiting-token ceiling (cfg max_waiting_tokens) would be passed,
--   'NOPERM ...' when the caller's ACL refuses a command this call may run (lib.lua acl_refused).
--   'CONFLICT <n> ...' when n ids of the call are ids the job already has with other content
--   (another shape or record: the first 16 hex digits of SHA-1(sig .. record) kept per id in
--   M:in:J:sums differ).
-- A re-sent id with the same content is a duplicate (-1); with other content it is another
--   job's item under a reused job name, whose old results a reader would take for its own.
-- Writes each record as sent to its lane list, and its input tokens to the lane's token list at
--   the same position. The producer builds the record: building it here cost over a quarter
--   of the server time per item (bench/RESULTS.md, bench/profiles/submit_profile.py), and the decode
--   that checks it is needed anyway.
-- The job's class (tenant, priority, deadline: job_class.lua, read from M:in:J) places its items:
--   a job of its own tenant in batch priority uses the signature's instances (several such jobs
--   of one shape share them, as always); any other class uses instances of a qualified signature
--   (16 hex digits of SHA-1 of signature, tenant and priority), so that no instance mixes tenants or
--   priority classes and a claim can choose between them (issue 26). An instance records its
--   tenant, priority and the earliest deadline of its jobs; an interactive one waits in M:hot.
-- Invariants: every argument is checked before the first write (all or nothing per call);
--   a lane list and its token list always have the same length, in the same order;
--   lanes only grow and are never merged; a draining or finished shape instance never takes
--   a new item: the signature's next epoch (staged) does.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
-- Rings the model's doorbell (cdr:{model}:bell, a list capped at 16 entries) when it adds items:
--   one entry per full batch they make, so that many idle workers blocked on it wake.
--@include lib.lua
--@include lib_submit_args.lua
--@include lib_submit_guard.lua
--@include lib_packed.lua
--@include lib_job_ids.lua
--@include lib_intake.lua
--@include lib_place.lua

local base, cfg_key, state_key = KEYS[1], KEYS[2], KEYS[3]
local intake_key = base .. ':intake'
local n = tonumber(ARGV[1])
if not int_in(n, 1, RULES.MAX_CALL_ITEMS) then
  return redis.error_reply('ERR_ARG n: item count must be an integer in 1..' .. RULES.MAX_CALL_ITEMS)
end
if #ARGV ~= 2 + 3 * n and #ARGV ~= 3 + 3 * n then
  return redis.error_reply('ERR_ARG argv: expected ' .. (2 + 3 * n) .. ' arguments (or one more: the sums), got ' ..
    #ARGV)
end
local sums = ARGV[3 + 3 * n]
if sums and (#sums ~= RULES.SUM_HEX * n or not string.match(sums, '^[0-9a-f]*$')) then
  return redis.error_reply('ERR_ARG sums: must be 16 lowercase hex digits per item, ' .. 16 * n .. ' in all')
end
local job = ARGV[2]
if not name_ok(job) then
  return redis.error_reply('ERR_ARG job: invalid job name')
end
local call, err = check_items(ARGV, n, job)
if not call then return err end
local ids = call.ids
err = prefixes_missing(base, call)
if err then return err end

local refused = paused(state_key)
if refused then return refused end
local cfg = load_cfg(cfg_key)
if cfg.max_waiting_tokens > 0 then
  local waiting = num(redis.call('HGET', intake_key, 'tokens'))
  if waiting + call.tokens > cfg.max_waiting_tokens then
    return redis.error_reply('FULL model queue holds ' .. waiting .. ' waiting tokens; ' .. call.tokens ..
      ' more would pass the ceiling of ' .. cfg.max_waiting_tokens)
  end
end
refused = submit_refused(base, state_key, intake_key, job)
if refused then return refused end
local now = now_ms()
-- The job's class (job_class.lua): a job without one is its own tenant, batch, without a deadline.
local class = job_class(base, job)
-- The submit context lib_intake.lua takes.
local intake = {base = base, cfg = cfg, now = now, depth = call.depth, ctxs = {}, class = class}

local job_sums = base .. ':in:' .. job .. ':sums'
local known, fresh_sums, conflicts, from_store, answered, stored, take =
  id_conflicts(job_sums, base .. ':job:' .. job .. ':items', base .. ':in:' .. job .. ':stored', ARGV, ids, n, sums)
if conflicts > 0 then
  return redis.error_reply('CONFLICT ' .. conflicts .. ' ids of this call are ids job ' .. job ..
    ' already has with other content')
end
local out, k = place_items(intake, ARGV, n, call, known, answered, from_store)
-- unpack() stops near 8,000 values: the new ids go in slices. Ids fed from the store leave the
-- stored ids (lib_packed.lua) for the registry, placed or answered meanwhile.
hset_pairs(job_sums, fresh_sums)
packed_drop(stored, take)
-- Lanes grow and counters move once per call and lane, not once per item.
for _, ctx in pairs(intake.ctxs) do grow_lanes(intake, ctx) end
count_placed(intake, job, intake_key, k)
return out
