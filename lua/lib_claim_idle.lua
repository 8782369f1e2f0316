-- lib_claim_idle.lua: claim.lua's answer for a consumer with nothing to claim, given before the
-- script defines the rest of its includes: an idle fleet polls, and a full claim pass costs the
-- server about 75 us (defining the includes' functions, which every EVALSHA does again, about 10 us
-- of it, the ACL pre-check about 8), this answer 18-30 us (bench/RESULTS.md, redis_cost notes).
-- Keys: M:intake, M:state (HMGET), M:affinity (HGET), M:hot and M:bat:<token> (one EXISTS), M:batches
--   (XPENDING COUNT 0).
-- Invariant: reads only; it answers 'idle' only where a full pass would answer 'idle' and write
--   nothing: nothing waits (lanes, staging, store segments, reclaimed, interactive), the model is not
--   in cleanup mode (whose end a full pass writes) and the consumer serves no instance (an emptied
--   one is finished by its full pass). A malformed call goes on to the full pass, which refuses it.
--@include lib.lua

-- The error reply when the batches stream lacks the consumer group ('NOGROUP'), or nil. XPENDING with
-- COUNT 0 answers an empty list, or NOGROUP, without reading the group's pending entries: a third of
-- the server time of XINFO GROUPS, whose reply describes every group.
local function claim_nogroup(batches_key)
  local got = redis.pcall('XPENDING', batches_key, GROUP, '-', '+', '0')
  if type(got) ~= 'table' or got.err then
    return redis.error_reply('NOGROUP ' .. batches_key .. ' has no consumer group ' .. GROUP .. ': nothing written')
  end
  return nil
end

-- claim.lua's KEYS and ARGV. Returns the reply ({0, 'idle'}, {0, 'paused'}, or NOGROUP's error), or nil
-- when a full claim pass must run, and then what it read that the full pass reads too (nil when the call
-- is malformed): {free = true when neither the batch token's list nor M:hot exists, intake = the model's
-- waiting counters and intake times, named as claim.lua reads them)}. The waiting counters are the
-- ones a full pass trusts for 'idle'.
local function claim_idle(base, state_key, batches_key, argv)
  local consumer = argv[1]
  if not (base and state_key and batches_key) or #argv ~= 4 or #consumer < 1 or #consumer > 200
      or not int_in(tonumber(argv[2]), 1, RULES.MAX_BATCH_ITEMS)
      or not int_in(tonumber(argv[3]), 1, RULES.MAX_BATCH_TOKENS)
      or not token_ok(argv[4]) then
    return nil
  end
  -- a batch token in use (the full pass refuses it) or interactive work waiting: one EXISTS for both
  if redis.call('EXISTS', base .. ':bat:' .. argv[4], base .. ':hot') ~= 0 then return nil end
  local it = redis.call('HMGET', base .. ':intake', 'items', 'tokens', 'stored_tokens', 'last_intake_ms', 'sealed_ms')
  -- built only for a full pass: an idle answer, the common one here, makes no table
  local function seen()
    return {free = true, intake = {items = it[1], tokens = it[2], stored_tokens = it[3], last_intake_ms = it[4],
      sealed_ms = it[5]}}
  end
  if num(it[1]) ~= 0 or num(it[2]) ~= 0 or num(it[3]) ~= 0 then return nil, seen() end
  local st = redis.call('HMGET', state_key, 'reclaimed_items', 'cleanup', 'paused')
  if num(st[1]) ~= 0 or st[2] == '1' then return nil, seen() end
  if redis.call('HGET', base .. ':affinity', consumer) then return nil, seen() end
  if st[3] == '1' then return {0, 'paused'} end
  return claim_nogroup(batches_key) or {0, 'idle'}
end
