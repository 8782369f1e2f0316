-- lib_gate.lua: claim.lua's release gate (seed 001) and its notion of quiet intake. Functions take
-- c, the claim context claim.lua builds (state_key, cfg, now, st, disk, sealed,
-- stored: the tokens waiting in the disk tier's store segments).
-- Keys: M:state gate and gate_opened_ms (written once, when the gate opens).
-- Invariant: once open the gate stays open; intake counts as quiet after quiet_ms of silence or
--   at once when a producer sealed its submission after the last item (seal.lua).

-- Intake is quiet after quiet_ms of silence, or at once when a producer sealed its submission
-- after the last item arrived (seal.lua).
local function quiet_since(c, last) return c.now - last >= c.cfg.quiet_ms or c.sealed >= last end

-- Release gate: memory mode dispatches nothing until enough is waiting to make good first
-- batches; once open it stays open. Quiet intake opens it too, so a small job still runs. What
-- waits in store segments (c.stored) counts towards the threshold, and keeps the answer 'gate'.
-- Returns the reply while it stays shut ({0, 'gate'} or {0, 'idle'}), or nil.
local function gate_shut(c, waiting, quiet)
  if c.st.gate == '1' then return nil end
  local cfg = c.cfg
  if c.disk or waiting + c.stored >= cfg.release_batches * cfg.budget_tokens or (quiet and waiting > 0) then
    redis.call('HSET', c.state_key, 'gate', 1, 'gate_opened_ms', c.now)
    return nil
  elseif waiting + c.stored > 0 then
    return {0, 'gate'}
  end
  return {0, 'idle'}
end
