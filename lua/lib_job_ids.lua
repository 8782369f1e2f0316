-- lib_job_ids.lua: submit.lua's idempotency check of a call's ids against the job's id registry
-- (M:in:J:sums, item id -> the first 16 hex digits of SHA-1(sig .. record)): an id the job has
-- already is a duplicate when it brings the same content, a conflict when it brings other content.
-- Keys: M:in:J:sums (read only here; submit.lua writes the new ids).
-- Invariant: one HMGET for the whole call (a call of 1,000 items would otherwise run 1,000
--   HSETNX); an id stored before sums were kept ('-', migrations/0003) cannot be judged and
--   stays a duplicate.

-- argv: submit.lua's ARGV (item i's sig at argv[3i], record at argv[3i + 1]); ids: the call's
-- ids in order; n: their count. Returns known (each id's stored sum, false if new), fresh_sums
-- (id, sum pairs of the new ids, each once) and the number of conflicting ids.
local function id_conflicts(job_sums, argv, ids, n)
  local known = redis.call('HMGET', job_sums, unpack(ids))
  local first, fresh_sums = {}, {}
  local conflicts = 0
  for i = 1, n do
    local o = 3 * i
    local sum = string.sub(redis.sha1hex(argv[o] .. argv[o + 1]), 1, 16)
    local id = ids[i]
    if known[i] then
      if known[i] ~= '-' and known[i] ~= sum then conflicts = conflicts + 1 end
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
