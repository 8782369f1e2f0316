#!lua flags=allow-oom
-- allow-oom: trimming is how a full Redis gets memory back. The shebang also makes a cluster node
-- refuse any key outside the slot of the model's hash tag.
-- trim.lua: give back the memory of a model's batches stream, never below a pending batch.
--
-- KEYS[1] batches   cdr:{model}:batches   (group "workers")
-- KEYS[2] finished  cdr:{model}:finished
-- ARGV[1] finished_keep  entries of the finished stream to keep (0..10000000)
-- Returns: {batches entries trimmed, finished entries trimmed, oldest pending id or ''}. Errors,
--   with nothing written: 'ERR_ARG ...'; 'NOPERM ...' when the caller's ACL refuses a command this
--   call may run (lib.lua acl_refused).
-- Invariants: every batch in the group's pending list survives (the trim stops at the
--   smallest pending id, read in the same atomic step, so a claim cannot slip in between);
--   entries below it were acknowledged and deleted already, and XTRIM frees the stream nodes
--   that XDEL leaves behind. The finished stream only feeds the thrash alarm: its newest
--   finished_keep entries stay.
--@include lib.lua

local batches_key, finished_key = KEYS[1], KEYS[2]
local keep = tonumber(ARGV[1])
if not keep or keep < 0 or keep > 10000000 or keep ~= math.floor(keep) then
  return redis.error_reply('ERR_ARG finished_keep: must be an integer in 0..10000000')
end

local refused = acl_refused(function(ok)
  return ok('EXISTS', batches_key) and ok('XPENDING', batches_key) and ok('XTRIM', batches_key)
    and ok('XTRIM', finished_key)
end)
if refused then return refused end

local trimmed, oldest = 0, ''
if redis.call('EXISTS', batches_key) == 1 then
  local summary = redis.call('XPENDING', batches_key, GROUP)
  if summary[1] > 0 then
    oldest = summary[2]
    trimmed = redis.call('XTRIM', batches_key, 'MINID', oldest)
  else
    -- Nothing in flight: every entry left is acknowledged (claim delivers what it adds in
    -- the same script), so the stream can be emptied; its group and last id stay.
    trimmed = redis.call('XTRIM', batches_key, 'MAXLEN', 0)
  end
end
local fin = redis.call('XTRIM', finished_key, 'MAXLEN', keep)
return {trimmed, fin, oldest}
