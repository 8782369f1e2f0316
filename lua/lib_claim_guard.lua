-- lib_claim_guard.lua: what claim.lua refuses before its first write, nothing written: malformed
-- arguments and a batch token in use ('ERR_ARG'), a command the caller's ACL denies ('NOPERM',
-- lib.lua acl_refused: every command claim.lua and its includes may call, on each key or key
-- pattern), and a batches stream without the consumer group ('NOGROUP': XCLAIM would refuse it
-- after the items moved).
-- Keys: reads only (EXISTS M:bat:<token>, XPENDING of M:batches: lib_claim_idle.lua claim_nogroup).
-- Invariant: a command added to claim.lua's includes is added here too
--   (tests/test_script_acl_atomicity.py denies each in turn).
--@include lib.lua
--@include lib_claim_idle.lua

-- The arguments (claim.lua's header), and the batch token not in use by a pending batch (token_free:
-- lib_claim_idle.lua saw its list absent in this call). Returns the error reply to return
-- ('ERR_ARG <field>: ...'), or nil.
local function claim_bad_args(base, consumer, max_items, max_tokens, token, token_free)
  local bad = consumer_bad(consumer)
  if bad then return bad end
  if not int_in(max_items, 1, RULES.MAX_BATCH_ITEMS) then
    return redis.error_reply('ERR_ARG max_batch_size: must be an integer in 1..' .. RULES.MAX_BATCH_ITEMS)
  end
  if not int_in(max_tokens, 1, RULES.MAX_BATCH_TOKENS) then
    return redis.error_reply('ERR_ARG max_batch_tokens: must be an integer in 1..' .. RULES.MAX_BATCH_TOKENS)
  end
  if not token_ok(token) then
    return redis.error_reply('ERR_ARG token: must be 1..' .. RULES.TOKEN_MAX .. ' characters from A-Z a-z 0-9 . _ -')
  end
  if not token_free and redis.call('EXISTS', base .. ':bat:' .. token) == 1 then
    return redis.error_reply('ERR_ARG token: ' .. token .. ' is in use by a pending batch')
  end
  return nil
end

-- Returns the error reply to return, or nil.
local function claim_refused(base, state_key, batches_key, reclaimed_key, batch_items_key)
  local I, L = base .. ':inst:0000000000000000:0', ':0000000000000000:0:0'
  local lk, tk, mk = base .. ':lane' .. L, base .. ':lanetok' .. L, base .. ':lanemeta' .. L
  local sk, sa, st, bk, rk = base .. ':staged', base .. ':staged_age', state_key, batch_items_key, reclaimed_key
  local il, fi, re, to, fr = I .. ':lanes', I .. ':fill', I .. ':ready', I .. ':touch', I .. ':free'
  local ac, af, wm = base .. ':active', base .. ':affinity', base .. ':warming'
  local refused = acl_refused(function(ok)
    return ok('HMGET', st) and ok('HSET', st) and ok('HINCRBY', st) and ok('HDEL', st) and ok('HGET', st)
      and ok('HMGET', base .. ':intake') and ok('HSET', base .. ':intake')
      and ok('ZADD', ac) and ok('ZREM', ac) and ok('ZRANGE', ac) and ok('HSET', af) and ok('HDEL', af)
      and ok('HGET', af) and ok('HGETALL', af) and ok('EXISTS', base .. ':hb:0')
      and ok('HKEYS', base .. ':workers') and ok('HGET', base .. ':tenants') and ok('HMGET', base .. ':vtc')
      and ok('HMGET', base .. ':vtc_ratio')
      and ok('HINCRBYFLOAT', base .. ':vtc') and ok('HSET', base .. ':vtc') and ok('HMGET', base .. ':vtc_seen')
      and ok('HSET', base .. ':vtc_seen') and ok('HINCRBY', base .. ':vtc_seen') and ok('HGETALL', base .. ':vtc_seen')
      and ok('EXISTS', base .. ':hot') and ok('ZRANGE', base .. ':hot')
      and ok('ZREM', base .. ':hot')
      and ok('HGET', wm) and ok('HSET', wm) and ok('HDEL', wm)
      and ok('ZRANK', fi) and ok('ZRANGE', fi) and ok('LRANGE', lk) and ok('LMPOP', lk)
      and ok('RPUSH', bk) and ok('XADD', batches_key) and ok('XCLAIM', batches_key) and ok('LINDEX', rk)
      and ok('LPOP', rk) and ok('LSET', rk) and ok('ZREM', sk) and ok('ZADD', sk) and ok('ZREVRANGE', sk)
      and ok('ZREM', sa) and ok('ZADD', sa) and ok('ZRANGE', sa) and ok('XADD', base .. ':finished')
      and ok('HSET', I) and ok('HGET', I) and ok('HMGET', I) and ok('ZREM', il) and ok('ZRANGE', il)
      and ok('ZREM', fi) and ok('ZADD', fi) and ok('ZREVRANGE', fi) and ok('ZREM', re) and ok('ZADD', re)
      and ok('ZRANGEBYSCORE', re) and ok('ZRANGE', re) and ok('ZREM', to) and ok('ZADD', to)
      and ok('ZRANGEBYSCORE', to) and ok('SADD', fr) and ok('LTRIM', lk) and ok('LRANGE', tk) and ok('LTRIM', tk)
      and ok('HMGET', mk) and ok('HSET', mk) and ok('HDEL', mk) and ok('HGET', mk) and ok('EXISTS', mk)
      and ok('TIME') and ok('XPENDING', batches_key) and ok('SORT', lk, 'STORE', bk)
      and ok('DEL', I, il, fi, re, fr, to) and ok('DEL', lk, tk, mk)
  end)
  if refused then return refused end
  return claim_nogroup(batches_key)
end
