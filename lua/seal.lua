#!lua
-- seal.lua: a producer declares the end of its submission (the last line of a file is in), so
-- the broker need not wait quiet_ms of silence before treating intake as quiet (seed 001's
-- cleanup mode, the release gate, an active shape's drain): the tail of a backlog goes at once.
--
-- KEYS[1] state   cdr:{model}:state   (read only: paused)
-- KEYS[2] intake  cdr:{model}:intake  (field sealed_ms: the producer's key, deploy/redis/users.acl)
-- KEYS[3] bell    cdr:{model}:bell (optional): rung once (capped at 16 entries, as submit.lua), so
--                an idle worker waiting for quiet intake claims at once
-- ARGV: none
-- Returns: the seal time (ms, the server's clock: the same clock submit.lua stamps
--   last_intake_ms with, so "sealed at or after the last intake" is exact).
-- Invariant: intake counts as quiet while no item arrived after the seal (claim.lua); any later
--   submit ends it, as silence would. Concurrent producers: one producer's seal can open
--   cleanup for the moments before another's next call, which then ends it (partial batches,
--   never a lost item).
-- Errors, with nothing written: 'NOPERM ...' when the caller's ACL refuses a command it may call
--   (lib.lua acl_refused).
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua

local state_key, intake_key, bell = KEYS[1], KEYS[2], KEYS[3]
local refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('HSET', intake_key) and ok('TIME')
    and (not bell or (ok('LPUSH', bell) and ok('LTRIM', bell)))
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end
local now = now_ms()
redis.call('HSET', intake_key, 'sealed_ms', now)
if bell then
  redis.call('LPUSH', bell, 1)
  redis.call('LTRIM', bell, 0, 15)
end
return now
