#!lua flags=allow-oom
-- allow-oom: repairing must work on a full Redis, which drains. The shebang also makes a cluster
-- node refuse any key outside the slot of the model's hash tag.
-- repair_items.lua: put items back where they belong (conductor inspect --verify --repair;
-- conductor/verify/repair.py repair_items). An operator's tool, not a hot path: one orphaned place per
-- call, every item of it read and decoded inside the call.
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] state      cdr:{model}:state
-- KEYS[3] batches    cdr:{model}:batches   (group "workers")
-- KEYS[4] reclaimed  cdr:{model}:reclaimed
-- ARGV[1] kind, then by kind:
--   'batch'  ARGV[2] token: the list cdr:{model}:bat:<token> that no pending batch names (a claim
--            or a reclaim that stopped halfway, before this fix); ARGV[3] sig, ARGV[4] epoch,
--            ARGV[5] lane, ARGV[6] deliveries: the shape instance and lane its items came from (a
--            batches entry that names the token, or the model's only signature, epoch and lane
--            0); ARGV[7] the id of that batches entry, or '': deleted when it is not pending
--   'lane'   ARGV[2] "S:E:L": a lane whose shape instance cdr:{model}:inst:S:E is gone (finished)
--   'done'   ARGV[2] "S:E:L": a lane of a live shape instance; its items with a result leave it
-- Returns: {moved, cleared, left}: items moved to the reclaimed list (batches of their shape of at
--   most 256 items, served first), items dropped because they have a result already, items left where they were
--   because no job of this model knows them (a human must look).
-- Errors, with nothing written: 'ERR_ARG ...'; 'ERR_STATE ...' when the place is not orphaned (a
--   pending batch names the token, the instance of a 'lane' exists, the instance of a 'done' lane
--   is gone), a lane and its token list differ in length, or a record does not decode; 'NOPERM ...'
--   when the caller's ACL refuses a command this call may run (lib.lua acl_refused); 'PAUSED ...'.
-- Invariants: an item without a result ('q') leaves an orphaned place only for the reclaimed list,
--   with its record as it is; an item with a result is dropped; the model's reclaimed_items counter
--   moves with the items it counts, and a 'done' lane's meta, instance and model counters with the
--   items that leave it (fill and ready scores are recounted by repair.lua, which the caller runs
--   next); a lane and its token list stay the same length. Everything is read before the first write.
--@include lib.lua
--@include lib_packed.lua

local base, state_key, batches_key, reclaimed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local kind, where = ARGV[1], ARGV[2]
local sig, ep, lane, dv, entry_id
local inst
if kind == 'batch' then
  if #ARGV ~= 7 then return redis.error_reply('ERR_ARG argv: batch takes 7 arguments') end
  sig, ep, lane, dv, entry_id = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
  if not where or #where < 1 or #where > 64 or not string.match(where, '^[%w%._-]+$') then
    return redis.error_reply('ERR_ARG token: must be 1..64 characters from A-Z a-z 0-9 . _ -')
  end
  if #sig ~= 16 or not string.match(sig, '^[0-9a-f]+$') then
    return redis.error_reply('ERR_ARG sig: must be 16 lowercase hex digits')
  end
  if not int_in(ep, 0, 1e15) or not int_in(lane, 0, 1e15) or not int_in(dv, 1, 1e9) then
    return redis.error_reply('ERR_ARG epoch, lane, deliveries: must be whole numbers')
  end
  if entry_id ~= '' and not stream_id_ok(entry_id) then
    return redis.error_reply('ERR_ARG entry: must be a stream id or empty')
  end
elseif kind == 'lane' or kind == 'done' then
  if #ARGV ~= 2 then return redis.error_reply('ERR_ARG argv: ' .. kind .. ' takes 2 arguments') end
  local s, e, l = string.match(where or '', '^(%x+):(%d+):(%d+)$')
  if not s or #s ~= 16 or #e > 15 or #l > 15 then
    return redis.error_reply('ERR_ARG lane: must be "S:E:L" (a signature, an epoch and a lane id)')
  end
  sig, ep, lane, dv = s, tonumber(e), tonumber(l), 1
  inst = s .. ':' .. e
else
  return redis.error_reply('ERR_ARG kind: must be batch, lane or done')
end

local ik = inst and (base .. ':inst:' .. inst)
local lk = kind == 'batch' and (base .. ':bat:' .. where) or (base .. ':lane:' .. where)
local tk = inst and (base .. ':lanetok:' .. where)
local mk = inst and (base .. ':lanemeta:' .. where)
local refused = acl_refused(function(ok)
  local jk = base .. ':job:0'
  return ok('XPENDING', batches_key) and ok('XRANGE', batches_key) and ok('XDEL', batches_key)
    and ok('LRANGE', lk) and ok('DEL', lk) and ok('RPUSH', lk) and ok('LSET', lk) and ok('LREM', lk)
    and ok('HGET', jk .. ':items') and ok('HGET', jk .. ':packed') and ok('HMGET', jk .. ':packed') and ok('HGET', base .. ':in:0:sums') and ok('RPUSH', reclaimed_key)
    and ok('HGET', state_key) and ok('HINCRBY', state_key) and ok('HINCRBY', base .. ':intake') and (not ik or (ok('EXISTS', ik) and ok('HINCRBY', ik)
      and ok('LRANGE', tk) and ok('LSET', tk) and ok('LREM', tk) and ok('DEL', tk, mk) and ok('HINCRBY', mk)))
end)
if refused then return refused end
refused = paused(state_key)
if refused then return refused end

-- The place must be orphaned, read in this call.
local entry_pending = false
if kind == 'batch' then
  for _, p in ipairs(redis.call('XPENDING', batches_key, GROUP, '-', '+', 100000)) do
    local e = redis.call('XRANGE', batches_key, p[1], p[1])[1]
    if e then
      for j = 1, #e[2], 2 do
        if e[2][j] == 'k' and e[2][j + 1] == where then
          return redis.error_reply('ERR_STATE token: pending batch ' .. p[1] .. ' names ' .. where)
        end
      end
    end
    if p[1] == entry_id then entry_pending = true end
  end
  if entry_pending then
    return redis.error_reply('ERR_STATE entry: ' .. entry_id .. ' is pending')
  end
else
  local live = redis.call('EXISTS', ik) == 1
  if kind == 'lane' and live then
    return redis.error_reply('ERR_STATE lane: instance ' .. inst .. ' exists (lua/repair.lua recounts its lanes)')
  elseif kind == 'done' and not live then
    return redis.error_reply('ERR_STATE lane: instance ' .. inst .. ' is gone (use kind lane)')
  end
end

local recs = redis.call('LRANGE', lk, 0, -1)
local toks = tk and redis.call('LRANGE', tk, 0, -1)
if toks and #toks ~= #recs then
  return redis.error_reply('ERR_STATE lane: ' .. lk .. ' holds ' .. #recs .. ' items but its token list ' ..
    #toks .. ' tokens')
end
local keep, keep_toks, stay, drop = {}, {}, {}, {}
local drop_tokens = 0
for i, rec in ipairs(recs) do
  local ok, it = pcall(cjson.decode, rec)
  if not ok or type(it) ~= 'table' or type(it[1]) ~= 'string' or type(it[2]) ~= 'string'
      or type(it[3]) ~= 'number' then
    return redis.error_reply('ERR_STATE ' .. lk .. ' holds an item record that does not decode')
  end
  local done = item_done(base .. ':job:' .. it[2], it[1])  -- a done mark, or packed (lib_packed.lua)
  if done then
    drop[#drop + 1] = i
    drop_tokens = drop_tokens + (toks and (tonumber(toks[i]) or 0) or it[3])
  elseif kind ~= 'done' and redis.call('HGET', base .. ':in:' .. it[2] .. ':sums', it[1]) then
    keep[#keep + 1] = rec
    keep_toks[#keep_toks + 1] = it[3]
  else
    stay[#stay + 1] = i
  end
end

if kind == 'done' then
  -- Only the items with a result leave a live lane, from both lists at their positions.
  if #drop > 0 then
    for _, i in ipairs(drop) do
      redis.call('LSET', lk, i - 1, '')
      redis.call('LSET', tk, i - 1, '')
    end
    redis.call('LREM', lk, 0, '')
    redis.call('LREM', tk, 0, '')
    redis.call('HINCRBY', mk, 'items', -#drop)
    redis.call('HINCRBY', mk, 'tokens', -drop_tokens)
    redis.call('HINCRBY', ik, 'items', -#drop)
    redis.call('HINCRBY', ik, 'tokens', -drop_tokens)
    redis.call('HINCRBY', base .. ':intake', 'items', -#drop)
    redis.call('HINCRBY', base .. ':intake', 'tokens', -drop_tokens)
  end
  return {0, #drop, #stay}
end

-- 'batch' and 'lane': the place keeps only what no job knows; the rest moves or goes.
local function push(key, list)  -- unpack() stops near 8,000 values
  for s = 1, #list, 1000 do redis.call('RPUSH', key, unpack(list, s, math.min(s + 999, #list))) end
end
if #keep > 0 or #drop > 0 then
  local left = {}
  for _, i in ipairs(stay) do left[#left + 1] = recs[i] end
  local left_toks = {}
  if toks then
    for _, i in ipairs(stay) do left_toks[#left_toks + 1] = toks[i] end
  end
  redis.call('DEL', lk)
  push(lk, left)
  if tk then
    redis.call('DEL', tk)
    push(tk, left_toks)
  end
end
if mk and #stay == 0 then redis.call('DEL', tk, mk) end
-- Reclaimed entries of at most 256 items: claim.lua unpacks what it takes of one entry.
for s = 1, #keep, 256 do
  local t, r = {}, {}
  for i = s, math.min(s + 255, #keep) do
    t[#t + 1] = keep_toks[i]
    r[#r + 1] = keep[i]
  end
  redis.call('RPUSH', reclaimed_key, cmsgpack.pack({sig, ep, lane, dv, t, r}))
end
if #keep > 0 then redis.call('HINCRBY', state_key, 'reclaimed_items', #keep) end
if kind == 'batch' and entry_id ~= '' then redis.call('XDEL', batches_key, entry_id) end
return {#keep, #drop, #stay}
