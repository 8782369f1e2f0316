-- lib_packed.lua: the compact form of a job's ids (issue 25), a hash of this layout:
--   'k'  how many hex digits of SHA-1(id) name an id's bucket (1..4, fixed when the hash is made)
--   'n'  how many ids the hash holds
--   'b' .. the first k hex digits of SHA-1(id): a string of 16-byte records, one per id: 8 bytes of
--        SHA-1(id) (hex digits 5..20) and the 8 bytes of its content sum (the registry's 16 hex digits)
-- Two hashes have it. M:job:J:packed holds answered ids: lua/compact_ids.lua moves an answered id
-- there from the id registry (M:in:J:sums) and the done marks (M:job:J:items) at once, about 16
-- bytes an id instead of about 135; an id found there is answered and known with that sum.
-- M:in:J:stored holds the ids waiting in store segments (register_segment.lua adds them, submit.lua
-- takes them out as the feeder places them, fail_stored.lua as it answers them): 16 bytes an id
-- instead of a registry entry of about 80, so a backlog of millions waits in a Redis of fixed size.
-- The Python mirror is conductor/redis_contract/packed_ids.py.
-- Keys: the hash given (packed_view reads 'k' and buckets; packed_drop and packed_append write
--   buckets and 'n' from what packed_view read, with no read of their own); M:job:J:items (read
--   only: the done marks, item_done and done_marks).
-- Invariant: an id is in one form at a time (registry, stored or packed), never two; a lookup
--   costs one HGET for a job without the hash.

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

-- What the hash key holds for the ids ids[i], i listed in want, read once (each bucket one HMGET
-- however many of the ids it holds): v.sums[i] = the 16 hex digits of id i's content sum when the
-- hash holds it; v.k the hash's bucket digits (nil: no hash yet); v.field[i], v.fp[i], v.at[i] where
-- its record is or goes; v.bucket[field] the bucket strings read (false: none). packed_drop and
-- packed_append write from this view without reading again.
local function packed_view(key, ids, want)
  local v = {key = key, ids = ids, sums = {}, field = {}, fp = {}, at = {}, bucket = {}}
  if #want == 0 then return v end
  v.k = tonumber(redis.call('HGET', key, 'k'))
  if not v.k then return v end
  local distinct = {}
  for _, i in ipairs(want) do
    v.field[i], v.fp[i] = packed_place(ids[i], v.k)
    if v.bucket[v.field[i]] == nil then
      v.bucket[v.field[i]] = false
      distinct[#distinct + 1] = v.field[i]
    end
  end
  for s = 1, #distinct, 2000 do
    local got = redis.call('HMGET', key, unpack(distinct, s, math.min(s + 1999, #distinct)))
    for j = 1, #got do v.bucket[distinct[s + j - 1]] = got[j] end
  end
  for _, i in ipairs(want) do
    local sum, at = packed_find(v.bucket[v.field[i]], v.fp[i])
    if sum then v.sums[i], v.at[i] = sum, at end
  end
  return v
end

-- For each index i listed in want: out[i] = the 16 hex digits of id ids[i]'s content sum when the
-- hash key holds it, else nothing.
local function packed_sums(key, ids, want)
  return packed_view(key, ids, want).sums
end

-- HSET of field/value pairs in slices (unpack() stops near 8,000 values).
local function hset_pairs(key, writes)
  for s = 1, #writes, 2000 do redis.call('HSET', key, unpack(writes, s, math.min(s + 1999, #writes))) end
end

-- Take the records of ids[i], i listed in idxs (each found in view v, each id once), out of its
-- hash: each bucket rewritten once, 'n' down by their number. Writes only.
local function packed_drop(v, idxs)
  if #idxs == 0 then return end
  local drop, order = {}, {}
  for _, i in ipairs(idxs) do
    local f = v.field[i]
    if not drop[f] then
      drop[f] = {}
      order[#order + 1] = f
    end
    drop[f][v.at[i]] = true
  end
  local writes = {}
  for _, f in ipairs(order) do
    local b, keep = v.bucket[f], {}
    for p = 1, #b, PACK_REC do
      if not drop[f][p] then keep[#keep + 1] = string.sub(b, p, p + PACK_REC - 1) end
    end
    v.bucket[f] = table.concat(keep)
    writes[#writes + 1] = f
    writes[#writes + 1] = v.bucket[f]
  end
  hset_pairs(v.key, writes)
  redis.call('HINCRBY', v.key, 'n', -#idxs)
end

-- Bucket digits for a hash about to hold `items` ids: buckets of about 32 ids (as
-- conductor/tier/compact_ids.py bucket_digits: a field costs some 50 bytes, a lookup reads a bucket).
local function packed_digits(items)
  local k = math.floor(math.log(math.max(items, 1) / 32) / math.log(16) + 0.5)
  return math.min(4, math.max(1, k))
end

-- Add ids[i] with content sum sums[i] (16 hex digits), i listed in idxs (each id once, none held),
-- to the hash of view v (read with want covering idxs); a new hash gets buckets of k_new digits.
-- Writes only.
local function packed_append(v, k_new, idxs, sums)
  if #idxs == 0 then return end
  local k = v.k or k_new
  local add, order = {}, {}
  for _, i in ipairs(idxs) do
    local f, fp = v.field[i], v.fp[i]
    if not v.k then f, fp = packed_place(v.ids[i], k) end
    if not add[f] then
      add[f] = {}
      order[#order + 1] = f
    end
    add[f][#add[f] + 1] = fp .. hex_bin(sums[i])
  end
  local writes = {'k', k}
  for _, f in ipairs(order) do
    writes[#writes + 1] = f
    writes[#writes + 1] = (v.bucket[f] or '') .. table.concat(add[f])
  end
  hset_pairs(v.key, writes)
  redis.call('HINCRBY', v.key, 'n', #idxs)
end

-- Whether each id of ids (a list) is answered: marks[i] == 'd' (the done marks' HMGET) or packed.
local function done_or_packed(key, ids, marks)
  local want, nw = {}, 0  -- counted: the length operator is a search in Lua 5.1
  for i = 1, #ids do
    if marks[i] ~= 'd' then nw = nw + 1; want[nw] = i end
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
  local v = packed_view(key, {id}, {1})
  local sum = v.sums[1]
  if sum then packed_drop(v, {1}) end
  return sum
end
