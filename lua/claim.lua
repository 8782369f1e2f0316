#!lua flags=allow-oom
-- allow-oom: at maxmemory a full Redis must still drain (this script frees or moves memory); only
-- submit.lua is refused, with QueueFull.
-- claim.lua: assemble one batch for one consumer under its contract and deliver it through
-- the consumer group: its entry goes straight into the consumer's pending list (XCLAIM FORCE)
-- (seeds 001, 002, 003).
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] cfg        cdr:{model}:cfg
-- KEYS[3] state      cdr:{model}:state     (and cdr:{model}:intake, the producer's counters)
-- KEYS[4] batches    cdr:{model}:batches   (group "workers")
-- KEYS[5] reclaimed  cdr:{model}:reclaimed
-- ARGV[1] consumer, ARGV[2] max_batch_size, ARGV[3] max_batch_tokens (a worker's input-length
--   limit is its runtime's business: the broker never strands an item over it)
-- ARGV[4] token      1..64 of [A-Za-z0-9._-], fresh per call: the batch's items go to the list
--                    cdr:{model}:bat:<token>, which the caller reads in the same pipeline
-- Returns: {1, batch_id, sig, epoch, lane, padded_len, claimed_at_ms, flags, deliveries, n,
--   warming}; flags: 1 cleanup, 2 reclaimed, 4 force-drained lane; n items are in the token's
--   list, in lane order, as item records (conductor/redis_contract/keys.py); warming is the shape instance
--   "sig:epoch" being pre-warmed ('' if none): the pre-warm signal. Or {0, reason} when nothing
--   is dispatched (reason: gate, wait, idle, paused). Errors, with nothing written: 'ERR_ARG
--   <field>: ...'; 'NOPERM ...' when the caller's ACL refuses a command it may call (checked
--   first, lib.lua acl_refused); 'NOGROUP ...' when the batches stream lacks the group.
-- Cost: sizes come from the lanes' token lists; the first lane's items move to the batch list
--   inside Redis (SORT BY nosort LIMIT STORE keeps list order and reads only the range it
--   stores), a neighbouring lane's pass through Lua (LRANGE, RPUSH), so the script's work grows
--   with the items in the batch, not with the queue.
-- Invariants: a batch holds items of ONE shape instance of ONE model, from one lane or from
--   neighbouring lanes in length order, padded to the rep of the longest lane taken; what does not
--   fit stays at the head of its lane, in order; assembly order is reclaimed work, then lanes;
--   dispatch stays on the active instance until it is empty (or an aged shape preempts it:
--   aging and lane hygiene are swept at most every 250 ms, see lib_serve.lua swept(); a fair loan
--   takes one batch of another tenant's active shape without leaving it, lib_rebalance.lua lend); each
--   worker warms at most one instance, its next; the work done grows with the batch (a bounded
--   number of lanes and at most SHAPE_VISITS instances are looked at), never with the queue.
-- This file is the dispatch order; each step lives in an include: lib_claim_guard.lua (refusals
--   before the first write), lib_deliver.lua (reclaimed work, moving and delivering a batch),
--   lib_gate.lua (the release gate, quiet intake), lib_workers.lua (who serves what),
--   lib_lifecycle.lua (activating, preempting, finishing), lib_survey.lua (what waits),
--   lib_pick.lua (the next instance to serve and to warm), lib_cleanup.lua (entering and leaving
--   cleanup mode), lib_serve.lua (aging, lane hygiene, interactive work, ready lanes, neighbour fill,
--   draining), lib_rebalance.lua (fair loans and switches), lib_lanes.lua (planning a batch from lanes).
--@include lib.lua
--@include lib_claim_idle.lua
-- Nothing to claim: answered before the rest is defined (lib_claim_idle.lua).
local idle_reply, seen = claim_idle(KEYS[1], KEYS[3], KEYS[4], ARGV)
if idle_reply then return idle_reply end
seen = seen or {}
--@include lib_claim_guard.lua
--@include lib_gate.lua
--@include lib_serve.lua
--@include lib_rebalance.lua

local base, cfg_key, state_key, batches_key, reclaimed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local consumer = ARGV[1]
local max_items, max_tokens = tonumber(ARGV[2]), tonumber(ARGV[3])
local token = ARGV[4]
local refused = claim_bad_args(base, consumer, max_items, max_tokens, token, seen.free)
if refused then return refused end
-- A caller that still sends the input-length limit ARGV[4] once held would name its batch list wrongly.
if #ARGV ~= 4 then return redis.error_reply('ERR_ARG argv: expected 4 arguments, got ' .. #ARGV) end
local batch_items_key = base .. ':bat:' .. token

-- Every cfg field this script (and the includes it calls) reads; tests/test_keys.py checks.
local CLAIM_CFG = {'mode', 'budget_tokens', 'budget_items', 'activate_batches', 'aging_ms', 'decode_weight',
  'drain_batches', 'hygiene_idle_ms', 'hygiene_items', 'lane_quiet_ms', 'prewarm_batches', 'quiet_ms',
  'release_batches', 'resident_tokens'}
local cfg = load_cfg(cfg_key, CLAIM_CFG)
refused = claim_refused(base, state_key, batches_key, reclaimed_key, batch_items_key)
if refused then return refused end
local now = now_ms()

-- The model's state, read once: every redis.call costs several microseconds here, and this
-- script runs once per batch. Only this script writes these counters while it runs (scripts
-- are atomic), so deliver() writes them back from these values.
local STATE = {'gate', 'cleanup_since_ms', 'cleanup', 'reclaimed_items', 'inflight_batches', 'inflight_items',
  'batches', 'warming', 'sweep_ms', 'paused'}
local st = hmget_named(state_key, STATE)
-- The waiting counters and intake times live in the producer's hash (M:intake, which
-- deploy/redis/users.acl lets a producer write; M:state it may only read).
local intake_key = base .. ':intake'
local intake = seen.intake
  or hmget_named(intake_key, {'tokens', 'last_intake_ms', 'items', 'sealed_ms', 'stored_tokens'})
-- The claim context every include takes. Each worker warms its own next instance (M:warming), so
-- in a fleet the shape a worker prepared is the one it switches to, not one another took first.
local c = {base = base, state_key = state_key, batches_key = batches_key, reclaimed_key = reclaimed_key,
  batch_items_key = batch_items_key, consumer = consumer, token = token, max_items = max_items,
  max_tokens = max_tokens, cfg = cfg, now = now, disk = cfg.mode == 'disk', st = st, intake_key = intake_key,
  -- now as '%d' text for the commands that write it (lib_deliver.lua: a Lua number argument costs
  -- Redis a '%.17g' format)
  now_s = string.format('%d', now),
  intake = intake, active_key = base .. ':active', affinity_key = base .. ':affinity',
  -- staged instances' fields read in this call (lib_survey.lua staged_fields)
  work = {},
  warming_key = base .. ':warming', sealed = num(intake.sealed_ms), sweep = now >= num(st.sweep_ms),
  -- the disk tier's store segments (conductor/tier/segments.py) wait too: the gate counts them, and a
  -- model whose lanes are empty while they wait is not idle (the feeder is loading them)
  stored = num(intake.stored_tokens)}
c.warming_now = redis.call('HGET', c.warming_key, consumer) or ''
c.cleanup = st.cleanup == '1'
-- Paused (see lib.lua paused()): nothing has been written yet, and nothing is.
if st.paused == '1' then return {0, 'paused'} end
-- New work ends cleanup mode (seed 001: "until empty or new work arrives"); submit.lua may not
-- write M:state, so the first claim after the intake ends it.
if c.cleanup and num(intake.last_intake_ms) > num(st.cleanup_since_ms) then
  exit_cleanup(state_key, now, num(st.cleanup_since_ms))
  c.cleanup = false
end

-- 1. Reclaimed work first (seed 001's assembly order).
if num(st.reclaimed_items) > 0 then
  local r = take_reclaimed(c)
  if r then return r end
end
-- 1b. Interactive work (issue 26): before the gate and before this worker's own shape.
if not seen.free and redis.call('EXISTS', base .. ':hot') == 1 then
  local r = serve_hot(c)
  if r then return r end
end
-- 2. The release gate.
local waiting = num(intake.tokens)
local quiet = quiet_since(c, num(intake.last_intake_ms))
c.quiet = quiet
local shut = gate_shut(c, waiting, quiet)
if shut then return shut end
-- 3. The worker's instance (M:affinity), else the next one (lib_pick.lua pick_next),
--    entering cleanup when nothing normal is ready and intake went quiet.
-- A pass that does not return a batch or a reason has emptied its instance and finished it;
-- SHAPE_VISITS bounds the instances one claim finishes and looks at, so a claim's work stays
-- bounded when several emptied instances linger (later claims finish the rest; this one
-- answers 'wait' meanwhile).
local SHAPE_VISITS = 4
local active, info = redis.call('HGET', c.affinity_key, consumer), nil
if active then
  info = inst_info(c, active)
  if not info.state then
    -- Finished by another worker's claim: the name goes too, or every idle claim of this consumer
    -- would take the full pass (lib_claim_idle.lua answers only a consumer that serves nothing).
    redis.call('HDEL', c.affinity_key, consumer)
    active = nil
  end
end
for _ = 1, SHAPE_VISITS do
  if not active then
    local reason
    active, reason = next_instance(c, quiet, waiting)
    if not active then return reason end
    info = inst_info(c, active)
  end
  indexed(c, active, info)
  local lent = nil
  if c.sweep then
    active, info = preempt_aged(c, active, info)
    active, info, lent = rebalance(c, active, info)
  elseif info.state == 'active' and fair_due(c, info.tenant or '', fair_gap(c, info)) then
    active, info, lent = rebalance(c, active, info)
  end
  if lent then return lent end
  if c.sweep then
    local r = hygiene(c, active, info)
    if r then return r end
  end
  local r = serve(c, active, info)
  if r then return r end
  finish(c, active)
  active = nil
end
return {0, 'wait'}
