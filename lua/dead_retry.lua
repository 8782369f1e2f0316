#!lua
-- The shebang (no flags) makes Redis 7 refuse this script at maxmemory before it runs and, on a
-- cluster node, refuse any key outside the slot of the model's hash tag.
-- dead_retry.lua: give dead-lettered items another chance, atomically.
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] state      cdr:{model}:state
-- KEYS[3] dead       cdr:{model}:dead
-- KEYS[4] reclaimed  cdr:{model}:reclaimed
-- ARGV[1..]          ids of entries in the dead stream (1..1000)
-- Returns: {retried, skipped}: skipped counts ids that are no longer in the dead stream (or are
--   repeated), and entries whose item no longer holds its dead-letter result (a purged job, a
--   second retry). Errors, with nothing written: 'ERR_ARG ids: ...'; 'NOPERM ...' when the
--   caller's ACL refuses a command this call may run (lib.lua acl_refused); 'ERR_STATE ...' for an
--   entry without a readable item; 'PAUSED ...'. Every entry is read before the first write.
-- Invariants: per retried item, in one step: its dead-letter result leaves the job's results
--   stream, its done mark goes (M:job:J:items, d -> none), the job's and the model's failed counters go down by
--   one, and it joins the reclaimed queue (served first) alone with its deliveries reset to 1;
--   so a job holds at most one result per item, and the item is delivered again at most
--   max_deliveries times before it comes back here. A job with an item taken back is no longer
--   ended: its end stamp ('ended_ms', 'end', lib_job_end.lua) goes, and the next last answer sets it.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
-- An answered item whose id was packed (lib_packed.lua, lua/compact_ids.lua) leaves the packed form
--   and its sum goes back to the job's id registry (M:in:J:sums), where it waits like any other.
--@include lib.lua
--@include lib_packed.lua

local base, state_key, dead_key, reclaimed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if #ARGV < 1 or #ARGV > 1000 then return redis.error_reply('ERR_ARG ids: give 1..1000 dead-letter ids') end
for i = 1, #ARGV do
  if not stream_id_ok(ARGV[i]) then
    return redis.error_reply('ERR_ARG ids: ' .. string.sub(ARGV[i], 1, 40) .. ' is not a stream id')
  end
end

local jp = base .. ':job:0'
local refused = acl_refused(function(ok)
  return ok('HGET', state_key) and ok('HINCRBY', state_key) and ok('XRANGE', dead_key) and ok('XDEL', dead_key)
    and ok('HGET', jp .. ':items') and ok('HDEL', jp .. ':items') and ok('XRANGE', jp .. ':results')
    and ok('XDEL', jp .. ':results') and ok('HINCRBY', jp) and ok('HDEL', jp) and ok('RPUSH', reclaimed_key)
    and ok('HGET', jp .. ':packed') and ok('HMGET', jp .. ':packed') and ok('HSET', jp .. ':packed')
    and ok('HINCRBY', jp .. ':packed') and ok('HSET', base .. ':in:0:sums')
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

-- Every entry read, checked and its item record built before the first write.
local todo, skipped, seen = {}, 0, {}
for i = 1, #ARGV do
  local entry = not seen[ARGV[i]] and redis.call('XRANGE', dead_key, ARGV[i], ARGV[i])[1]
  seen[ARGV[i]] = true
  local f = {}
  if entry then
    for j = 1, #entry[2], 2 do f[entry[2][j]] = entry[2][j + 1] end
  end
  local jk = f.job and f.id and (base .. ':job:' .. f.job)
  local item = jk and (f.job .. ':' .. f.id)
  -- Its item must still hold this entry's dead-letter result (not after a purge or a retry).
  local ok = jk and not seen[item] and item_done(jk, f.id) and f.rid
    and stream_id_ok(f.rid) and redis.call('XRANGE', jk .. ':results', f.rid, f.rid)[1] ~= nil
  if ok then
    seen[item] = true
    local tok = tonumber(f.tok)
    local rec = f.it
    if not rec then
      -- migrations/0004 gave every schema-1 entry its item record; one it could not read has none
      return redis.error_reply('ERR_STATE dead entry ' .. ARGV[i] .. ' holds no readable item: nothing written')
    end
    if not tok then
      return redis.error_reply('ERR_STATE dead entry ' .. ARGV[i] .. ' has no input tokens: nothing written')
    end
    todo[#todo + 1] = {eid = ARGV[i], jk = jk, id = f.id, rid = f.rid, tok = tok, job = f.job,
      blob = cmsgpack.pack({f.sig, tonumber(f.ep), tonumber(f.lane), 1, {tok}, {rec}})}
  else
    skipped = skipped + 1
  end
end

for _, t in ipairs(todo) do
  redis.call('XDEL', t.jk .. ':results', t.rid)
  if redis.call('HDEL', t.jk .. ':items', t.id) == 0 then  -- packed: back to the registry
    redis.call('HSET', base .. ':in:' .. t.job .. ':sums', t.id, packed_remove(t.jk .. ':packed', t.id))
  end
  redis.call('HINCRBY', t.jk, 'failed', -1)
  redis.call('HDEL', t.jk, 'ended_ms', 'end')
  redis.call('HINCRBY', state_key, 'failed', -1)
  redis.call('HINCRBY', state_key, 'dead_retried', 1)
  redis.call('RPUSH', reclaimed_key, t.blob)
  redis.call('HINCRBY', state_key, 'reclaimed_items', 1)
  redis.call('XDEL', dead_key, t.eid)
end
return {#todo, skipped}
