-- lib_job_ids.lua: submit.lua's idempotency check of a call's ids against the job's id registry
-- (M:in:J:sums, item id -> the first 16 hex digits of SHA-1(sig .. record)): an id the job has
-- already is a duplicate when it brings the same content, a conflict when it brings other content.
-- Keys: M:in:J:sums (read only here; submit.lua writes the new ids); M:job:J:items (read only: the
--   done marks of ids fed from the store); M:job:J:packed (read only: answered ids in their compact
--   form); M:in:J:stored (read only here: ids waiting in store segments, the same packed layout;
--   submit.lua takes the placed ones out with packed_drop). lib_packed.lua must be included first.
-- Invariant: one HMGET for the whole call (a call of 1,000 items would otherwise run 1,000
--   HSETNX), one more per packed hash the job has; an id stored before sums were kept ('-',
--   migrations/0003) cannot be judged and stays a duplicate; an id registered by
--   register_segment.lua (in M:in:J:stored: it waits in a store segment of the disk tier) with the
--   same sum is placed by this call, once (it then leaves the stored ids for the registry, with
--   its plain sum), and with another sum is a conflict; one that has its result already (a cancel
--   or an expiry answered it while it waited in the segment) is not placed: answered.

-- argv: submit.lua's ARGV (item i's sig at argv[3i], record at argv[3i + 1]); ids: the call's
-- ids in order; n: their count; stored_key: the job's M:in:J:stored. Returns known (each id's
-- stored sum, false if new), fresh_sums (id, sum pairs of the new ids, each once), the number of
-- conflicting ids, from_store (true at i when id i waits in a store segment with this content: it
-- counts as new here, and moves from the stored counters to the waiting ones), answered (true at i
-- when id i, fed from the store, has its result already: it leaves the stored counters without
-- being placed), and the stored ids' view with the indices to take out of it (lib_packed.lua
-- packed_drop: each store-waiting id of the call once).
-- sums: the call's content sums as the producer sent them (submit.lua ARGV[3+3n]), or nil: computed here.
local function id_conflicts(job_sums, done_key, stored_key, argv, ids, n, sums)
  local known = redis.call('HMGET', job_sums, unpack(ids))
  local want, nw = {}, 0  -- counted: the length operator is a search in Lua 5.1
  for i = 1, n do
    if not known[i] then nw = nw + 1; want[nw] = i end
  end
  -- an answered id compacted out of the registry (lib_packed.lua): known, with its sum
  local packed = packed_sums(string.sub(done_key, 1, -7) .. ':packed', ids, want)
  for i, p in pairs(packed) do known[i] = p end
  local unknown, nu = {}, 0
  -- a numeric loop: ipairs calls its iterator (a C function) once per new id
  for j = 1, nw do
    local i = want[j]
    if not known[i] then nu = nu + 1; unknown[nu] = i end
  end
  local stored = packed_view(stored_key, ids, unknown)
  local first, fresh_sums, from_store, take = {}, {}, {}, {}
  local conflicts = 0
  local sub = string.sub  -- read once: the loop runs once per item
  local nf = 0  -- #fresh_sums, counted (the length operator is a search in Lua 5.1)
  for i = 1, n do
    local o = 3 * i
    local sum = sums and sub(sums, 16 * i - 15, 16 * i)
      or sub(redis.sha1hex(argv[o] .. argv[o + 1]), 1, 16)
    local id = ids[i]
    local had = stored.sums[i]
    if had then
      if had == sum then from_store[i] = true else known[i] = had end  -- other content: a conflict below
    end
    if known[i] then
      if known[i] ~= '-' and known[i] ~= sum then conflicts = conflicts + 1 end
    elseif first[id] then
      if first[id] ~= sum then conflicts = conflicts + 1 end
    else
      first[id] = sum
      nf = nf + 2
      fresh_sums[nf - 1], fresh_sums[nf] = id, sum
      if from_store[i] then take[#take + 1] = i end
    end
  end
  local answered = {}
  for s = 1, #take, 2000 do
    local part = {}
    for j = s, math.min(s + 1999, #take) do part[#part + 1] = ids[take[j]] end
    local marks = redis.call('HMGET', done_key, unpack(part))
    for j = 1, #marks do
      if marks[j] == 'd' then answered[take[s + j - 1]] = true end
    end
  end
  return known, fresh_sums, conflicts, from_store, answered, stored, take
end
