-- lib_record_parts.lua: an item record (conductor/redis_contract/keys.py: the JSON array [id, job,
-- input_tokens, max_tokens, prompt, payload]) read for its id, job, input tokens and payload without
-- decoding the prompt, the payload kept as the bytes its producer sent (cancel_lane.lua answers an
-- item with them).
-- Keys: none. Invariant: pure; a record the fast pattern does not take is decoded with cjson, and one
--   cjson does not take either gives nil.

-- The end of the JSON string whose opening quote is at str[i]: the index of its closing quote.
local function string_end(str, i)
  local j = i + 1
  while true do
    local k = string.find(str, '["\\]', j)
    if not k then return nil end
    if string.byte(str, k) == 92 then j = k + 2 else return k end
  end
end

-- id, job, input tokens and the payload's JSON text of an item record, or nil.
local function record_parts(rec)
  local id, rjob, tok, at = string.match(rec, '^%["([^"\\]*)","([^"\\]*)",(%d+),%d+,()"')
  local q = at and string_end(rec, at)
  local payload = q and string.match(rec, '^,(.*)%]$', q + 1)
  if payload then return id, rjob, tonumber(tok), payload end
  local okd, d = pcall(cjson.decode, rec)
  if not (okd and type(d) == 'table' and type(d[1]) == 'string') then return nil end
  local oke, p = pcall(cjson.encode, d[6])
  return d[1], d[2], tonumber(d[3]) or 0, (d[6] ~= nil and oke) and p or 'null'
end
