-- lib_batch_members.lua: which (job, id) an in-flight batch holds, for complete.lua's check that
-- every result it is given belongs to the batch.
-- Keys: M:bat:<token> (LRANGE), read only.
-- Invariant: an item record is read from its head when it is plain compact JSON (what
--   conductor/redis_contract/item_record.py builds), decoded otherwise; a record that is neither adds nothing, so a
--   result for it is refused rather than taken.

-- items_key: the batch's items list (M:bat:<token>). Returns members[job][id] = true.
local function batch_members(items_key)
  local members = {}
  local match = string.match  -- read once: the loop runs once per item
  local recs = redis.call('LRANGE', items_key, '0', '-1')
  -- a numeric loop: ipairs calls its iterator (a C function) once per item
  for i = 1, #recs do
    local rec = recs[i]
    -- a match gives strings: only a decoded record's fields need their type checked
    local id, job = match(rec, '^%["([^"\\]*)","([^"\\]*)",')
    if not id then
      local ok, d = pcall(cjson.decode, rec)
      if ok and type(d) == 'table' and type(d[1]) == 'string' and type(d[2]) == 'string' then
        id, job = d[1], d[2]
      end
    end
    if id then
      local m = members[job]
      if not m then
        m = {}
        members[job] = m
      end
      m[id] = true
    end
  end
  return members
end
