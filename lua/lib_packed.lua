-- lib_packed.lua: the compact form of a job's answered ids (issue 25), M:job:J:packed, a hash:
--   'k'  how many hex digits of SHA-1(id) name an id's bucket (1..4, fixed at the job's first compaction)
--   'n'  how many ids the packed form holds
--   'b' .. the first k hex digits of SHA-1(id): a string of 16-byte records, one per id: 8 bytes of
--        SHA-1(id) (hex digits 5..20) and the 8 bytes of its content sum (the registry's 16 hex digits)
-- lua/compact_ids.lua moves an answered id here from the id registry (M:in:J:sums) and the done
-- marks (M:job:J:items) at once: about 16 bytes an id instead of about 135. An id found here is
-- answered and known to the registry with that sum; the Python mirror is
-- conductor/redis_contract/packed_ids.py.
-- Keys: M:job:J:packed (read only here: HGET k, HMGET buckets); M:job:J:items (read only: the done
--   marks, item_done and done_marks).
-- Invariant: an id is in the packed form, or in the registry and done marks, never both; a
--   lookup costs one HGET for a job that never compacted.

local PACK_REC = 16

local function hex_bin(h)
  return (string.gsub(h, '..', function(x) return string.char(tonumber(x, 16)) end))
end

local function bin_hex(b)
  return (string.gsub(b, '.', function(c) return string.format('%02x', string.byte(c)) end))
end

-- id's bucket field and its 8-byte fingerprint, for buckets of k hex digits
local function packed_place(id, k)
  local h = redis.sha1hex(id)
  return 'b' .. string.sub(h, 1, k), hex_bin(string.sub(h, 5, 20))
end

-- the 16 hex digits of the sum stored with fingerprint fp in bucket string b and where its record
-- begins, or nil
local function packed_find(b, fp)
  if not b then return nil end
  local from = 1
  while true do
    local p = string.find(b, fp, from, true)
    if not p then return nil end
    if (p - 1) % PACK_REC == 0 then return bin_hex(string.sub(b, p + 8, p + 15)), p end
    from = p + 1
  end
end

-- For each index i listed in want: out[i] = the 16 hex digits of id ids[i]'s content sum when the
-- job's packed form (key) holds it (the id is answered), else nothing.
local function packed_sums(key, ids, want)
  local out = {}
  if #want == 0 then return out end
  local k = tonumber(redis.call('HGET', key, 'k'))
  if not k then return out end
  local fields, fps, distinct, bucket = {}, {}, {}, {}
  for j, i in ipairs(want) do
    fields[j], fps[j] = packed_place(ids[i], k)
    if bucket[fields[j]] == nil then
      bucket[fields[j]] = false
      distinct[#distinct + 1] = fields[j]
    end
  end
  for s = 1, #distinct, 2000 do  -- each bucket read once, however many of the ids it holds
    local got = redis.call('HMGET', key, unpack(distinct, s, math.min(s + 1999, #distinct)))
    for j = 1, #got do bucket[distinct[s + j - 1]] = got[j] end
  end
  for j, i in ipairs(want) do
    local sum = (packed_find(bucket[fields[j]], fps[j]))
    if sum then out[i] = sum end
  end
  return out
end

-- Whether each id of ids (a list) is answered: marks[i] == 'd' (the done marks' HMGET) or packed.
local function done_or_packed(key, ids, marks)
  local want = {}
  for i = 1, #ids do
    if marks[i] ~= 'd' then want[#want + 1] = i end
  end
  local packed = packed_sums(key, ids, want)
  for i in pairs(packed) do marks[i] = 'd' end
  return marks
end

-- Whether one id of the job whose keys begin jk (M:job:J) is answered: a done mark or packed.
local function item_done(jk, id)
  return redis.call('HGET', jk .. ':items', id) == 'd' or packed_sums(jk .. ':packed', {id}, {1})[1] ~= nil
end

-- The done marks of ids (a list) of the job whose keys begin jk (M:job:J), in slices of 2,000, with
-- each packed id as 'd'.
local function done_marks(jk, ids)
  local marks = {}
  for s = 1, #ids, 2000 do
    local got = redis.call('HMGET', jk .. ':items', unpack(ids, s, math.min(s + 1999, #ids)))
    for j = 1, #got do marks[s + j - 1] = got[j] end
  end
  return done_or_packed(jk .. ':packed', ids, marks)
end

-- Take id out of the packed form of key (dead_retry.lua: an answered item goes back to the queue):
-- its record leaves its bucket and the count. Returns its sum (the caller puts it back in the
-- registry), or nil when the packed form does not hold it.
local function packed_remove(key, id)
  local k = tonumber(redis.call('HGET', key, 'k'))
  if not k then return nil end
  local field, fp = packed_place(id, k)
  local b = redis.call('HGET', key, field)
  local sum, at = packed_find(b, fp)
  if not sum then return nil end
  redis.call('HSET', key, field, string.sub(b, 1, at - 1) .. string.sub(b, at + PACK_REC))
  redis.call('HINCRBY', key, 'n', -1)
  return sum
end
