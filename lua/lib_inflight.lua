-- lib_inflight.lua: the ids of one job's items in flight on a model, read from every pending batch's
-- items list (cancel_registry.lua, cancel_lane.lua and cancel_segment.lua leave those items alone:
-- their batches finish and keep their results).
-- Keys: M:batches (XPENDING, XRANGE; group "workers"), M:bat:<token> (LRANGE).
-- Invariant: reads only, bounded by what is in flight, never by the queue; a batches stream without
--   the group (no worker ever registered: submit leaves that to workers) has nothing in flight.
--@include lib.lua

-- The commands inflight_ids may run, as checks for lib.lua acl_refused.
local function inflight_ok(ok, base, batches_key)
  return ok('XPENDING', batches_key) and ok('XRANGE', batches_key) and ok('LRANGE', base .. ':bat:0')
end

-- The set {id -> true} of job's items in pending batches, or nil and the error reply XPENDING gave
-- (anything but a missing group).
local function inflight_ids(base, batches_key, job)
  local inflight = {}
  local pending = redis.pcall('XPENDING', batches_key, GROUP, '-', '+', 100000)
  if type(pending) == 'table' and pending.err then
    if not string.find(pending.err, 'NOGROUP') then return nil, pending end
    pending = {}
  end
  for _, p in ipairs(pending) do
    local entry = redis.call('XRANGE', batches_key, p[1], p[1])[1]
    local token = nil
    if entry then
      local f = entry[2]
      for j = 1, #f, 2 do
        if f[j] == 'k' then token = f[j + 1] end
      end
    end
    if token then
      for _, rec in ipairs(redis.call('LRANGE', base .. ':bat:' .. token, 0, -1)) do
        local id, rjob = string.match(rec, '^%["([^"\\]*)","([^"\\]*)",')
        if not id then
          local okd, d = pcall(cjson.decode, rec)
          if okd and type(d) == 'table' then id, rjob = d[1], d[2] end
        end
        if rjob == job and type(id) == 'string' then inflight[id] = true end
      end
    end
  end
  return inflight
end
