-- lib_job_ids.lua: submit.lua's idempotency check of a call's ids against the job's: an id the job
-- has already is a duplicate when it brings the same content (the first 16 hex digits of
-- SHA-1(sig .. record), kept per id in M:job:J:sums), a conflict when it brings other content.
-- Keys: M:job:J:items and M:job:J:sums (read only here; submit.lua writes the new ids).
-- Invariant: one HMGET per hash for the whole call (a call of 1,000 items would otherwise run
--   1,000 HSETNX); an id stored before sums were kept has none and stays a duplicate.

-- argv: submit.lua's ARGV (item i's sig at argv[3i], record at argv[3i + 1]); ids: the call's
-- ids in order; n: their count. Returns known (the job's state of each id, false if new),
-- fresh_sums (id, sum pairs of the new ids, each once) and the number of conflicting ids.
local function id_conflicts(job_items, job_sums, argv, ids, n)
  local known = redis.call('HMGET', job_items, unpack(ids))
  local first, fresh_sums, had = {}, {}, {}
  for i = 1, n do
    if known[i] then had[#had + 1] = ids[i] end
  end
  if #had > 0 then had = redis.call('HMGET', job_sums, unpack(had)) end
  local conflicts, h = 0, 0
  for i = 1, n do
    local o = 3 * i
    local sum = string.sub(redis.sha1hex(argv[o] .. argv[o + 1]), 1, 16)
    local id = ids[i]
    if known[i] then
      h = h + 1
      if had[h] and had[h] ~= sum then conflicts = conflicts + 1 end
    elseif first[id] then
      if first[id] ~= sum then conflicts = conflicts + 1 end
    else
      first[id] = sum
      fresh_sums[#fresh_sums + 1] = id
      fresh_sums[#fresh_sums + 1] = sum
    end
  end
  return known, fresh_sums, conflicts
end
