-- lib_cleanup.lua: cleanup mode (seed 001), entered and left by claim.lua (left when the model
-- went idle, or when it sees intake newer than the cleanup's start: submit.lua may not write
-- M:state). In cleanup the activation threshold is 0 and batches go down to one item, until the
-- model is empty or intake resumes.
-- Keys: M:state fields cleanup, cleanup_since_ms, cleanup_entries, cleanup_ms.
-- Invariant: cleanup_ms grows by each cleanup period's length once, when the period ends.

-- Enter cleanup (the caller checked it is not in cleanup already).
local function enter_cleanup(state_key, now)
  redis.call('HSET', state_key, 'cleanup', 1, 'cleanup_since_ms', now)
  redis.call('HINCRBY', state_key, 'cleanup_entries', 1)
end

-- Leave cleanup (the caller checked it is in cleanup): the period's length goes to cleanup_ms.
-- since: the period's start when the caller read it already (nil: read here).
local function exit_cleanup(state_key, now, since)
  since = since or tonumber(redis.call('HGET', state_key, 'cleanup_since_ms')) or 0
  redis.call('HINCRBY', state_key, 'cleanup_ms', math.max(0, now - since))
  redis.call('HSET', state_key, 'cleanup', 0)
end
