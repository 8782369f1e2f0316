-- lib_submit_args.lua: submit.lua's checks of its items (seed 002's intake edge), before anything is
-- written: each record decodes as the item record workers read (conductor/redis_contract/keys.py), each id,
-- job, token count and prefix is well formed, and a new signature brings its prefix.
-- Keys: M:shape:S (HEXISTS prefix) only. Invariant: reads only; every refusal is an 'ERR_ARG
--   <field>: ... at item <i>' reply and nothing is written.
--@include lib.lua

-- The limits are rules.py's (RULES, lib_generated.lua), which conductor/formats/checks.py applies
-- too: the edge refuses first; the script refuses what other clients send.

-- argv: submit.lua's ARGV (3 fields per item from argv[3]), n items, job the call's job.
-- Returns call = {tokens (input tokens of the call), ids, toks and mts (per item: input tokens, output
-- limit), sigs (set of the call's signatures), prefixes (per signature, the first prefix the call carries), depth (per
-- signature, {tokens, items} the call brings)}, or nil and the error reply to return.
local function check_items(argv, n, job)
  local call_tokens = 0
  -- Per item, from the decode that checks its record: its id and input tokens.
  local ids, toks, mts = {}, {}, {}
  -- A call's items nearly always share a few shapes: each distinct one is pattern-checked once.
  local sigs_ok = {}
  -- Per signature, the first prefix the call carries (stored once below) or nil.
  local prefixes = {}
  -- Per signature, what this call brings: the depth rule counts it before the first item is placed,
  -- so a backlog sent in a few calls gets the lanes its whole depth deserves.
  local call_depth = {}
  -- The loop runs once per item: globals read once here, int_in (lib.lua) written out below.
  local cjson_decode, byte, type = cjson.decode, string.byte, type
  local max_rec, max_id, max_tok, max_out = RULES.MAX_RECORD_BYTES, RULES.MAX_ID_BYTES, RULES.MAX_INPUT_TOKENS,
    RULES.MAX_OUTPUT_TOKENS
  for i = 0, n - 1 do
    local o = 3 + 3 * i
    local sig, rec, prefix = argv[o], argv[o + 1], argv[o + 2]
    if not sigs_ok[sig] then
      if not hex_ok(sig, RULES.SIG_HEX) then
        return nil, redis.error_reply('ERR_ARG sig: must be 16 lowercase hex digits at item ' .. i)
      end
      sigs_ok[sig] = true
    end
    if #rec > max_rec or #prefix > max_rec then
      return nil, redis.error_reply('ERR_ARG record: larger than ' .. max_rec .. ' bytes at item ' .. i)
    end
    -- Workers decode the record as it is stored: a malformed one would fail every delivery until
    -- dead-lettered.
    -- A text that starts with '[' and decodes is an array: no type() call needed once the byte is seen.
    local ok, d = pcall(cjson_decode, rec)
    if not ok or byte(rec, 1) ~= 91 or #d < 5 or #d > 6 then
      return nil, redis.error_reply('ERR_ARG record: must be a JSON array [id, job, input_tokens, ' ..
        'max_tokens, prompt, payload] at item ' .. i)
    end
    local id, tok, mt = d[1], d[3], d[4]
    if type(id) ~= 'string' or #id < 1 or #id > max_id then
      return nil, redis.error_reply('ERR_ARG id: must be a string of 1..' .. max_id .. ' bytes at item ' .. i)
    end
    if d[2] ~= job then
      return nil, redis.error_reply('ERR_ARG job: the record names another job than the call at item ' .. i)
    end
    -- x % 1 == 0: whole, as x == floor(x) for the finite x the bounds leave, without a C call
    if type(tok) ~= 'number' or not (tok >= 1 and tok <= max_tok and tok % 1 == 0) then
      return nil, redis.error_reply('ERR_ARG input_tokens: must be an integer in 1..' .. max_tok .. ' at item ' .. i)
    end
    if type(mt) ~= 'number' or not (mt >= 1 and mt <= max_out and mt % 1 == 0) then
      return nil, redis.error_reply('ERR_ARG max_tokens: must be an integer in 1..' .. max_out .. ' at item ' .. i)
    end
    if type(d[5]) ~= 'string' then
      return nil, redis.error_reply('ERR_ARG prompt: must be a string at item ' .. i)
    end
    if prefix ~= '' then
      -- As conductor/formats/native.py: a JSON list of strings (workers pass it to the engine as is).
      ok, d = pcall(cjson_decode, prefix)
      local good = ok and type(d) == 'table' and string.find(prefix, '^%s*%[') ~= nil
      if good then
        local k = 0
        for _, v in pairs(d) do
          k = k + 1
          if type(v) ~= 'string' then good = false break end
        end
        good = good and k == #d and k <= RULES.MAX_PREFIX_PARTS
      end
      if not good then
        return nil, redis.error_reply('ERR_ARG prefix: must be a JSON list of at most ' .. RULES.MAX_PREFIX_PARTS ..
          ' strings at item ' .. i)
      end
      if not prefixes[sig] then prefixes[sig] = prefix end
    end
    ids[i + 1], toks[i + 1], mts[i + 1] = id, tok, mt
    call_tokens = call_tokens + tok
    local d = call_depth[sig]
    if not d then
      d = {tokens = 0, items = 0}
      call_depth[sig] = d
    end
    d.tokens = d.tokens + tok
    d.items = d.items + 1
  end
  return {tokens = call_tokens, ids = ids, toks = toks, mts = mts, sigs = sigs_ok, prefixes = prefixes,
    depth = call_depth}
end

-- A signature without a stored prefix (a new one) needs the call to carry it: workers read the
-- shape's prefix from there.
-- Returns the error reply to return, or nil.
local function prefixes_missing(base, call)
  for sig in pairs(call.sigs) do
    if not call.prefixes[sig] and redis.call('HEXISTS', base .. ':shape:' .. sig, 'prefix') == 0 then
      return redis.error_reply('ERR_ARG prefix: signature ' .. sig .. ' has no prefix yet: the call must carry ' ..
        'its prefix (a JSON list of strings) on one of its items')
    end
  end
  return nil
end
