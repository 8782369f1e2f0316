-- lib_service.lua: what complete.lua counts of the service each job and tenant received (issue 26):
-- the padded input tokens (a result's batch_padded_len) and output tokens of every newly written
-- result, to its job (M:job:J served_in, served_out) and to its job's tenant (M:in:J tenant, else
-- the job) in M:served and in the ten-second bucket M:served10:N (N = seconds // 10, expiring after
-- 120 s), as fields "T:in" and "T:out". `conductor tenants` and the exporter read them.
-- Keys: M:job:J (HINCRBY), M:in:J (HGET tenant), M:served and M:served10:N (HINCRBY, EXPIRE),
--   M:vtc_ratio (HINCRBYFLOAT, HSET).
-- Invariant: counted once per result written (complete.lua calls it for results it writes now).
--@include lib.lua

-- The padded input tokens and output tokens of k results, argv[o + 3] for o in ats[1..k], read from
-- their JSON without decoding it. Adds them to g.pin and g.pout. Once a job and call, not once a
-- result: the sums kept in locals, and result_int (lib_generated.lua, from records.Result) written out
-- for its two fields with RESULT_INT's anchors: three Lua calls and four global reads a result fewer.
local function add_tokens(g, argv, ats, k)
  local pin, pout = g.pin or 0, g.pout or 0
  local find, match = string.find, string.match
  local out_key, pin_key = RESULT_INT.output_tokens, RESULT_INT.batch_padded_len
  for j = 1, k do
    local r = argv[ats[j] + 3]
    local _, e = find(r, out_key, 1, true)
    local d = e and match(r, '^%d+', e + 1)
    pout = pout + (d and d + 0 or 0)  -- digits: one conversion (tonumber makes two)
    -- output_tokens comes before batch_padded_len in Result (records.py): the second find starts there
    local _, e2 = find(r, pin_key, e or 1, true)
    if not e2 and e then _, e2 = find(r, pin_key, 1, true) end
    d = e2 and match(r, '^%d+', e2 + 1)
    pin = pin + (d and d + 0 or 0)
  end
  g.pin, g.pout = pin, pout
end

-- What counting may run (lib.lua acl_refused's ok), before complete.lua's first write.
local function service_ok(ok, base)
  return ok('TIME') and ok('HINCRBY', base .. ':served') and ok('HINCRBY', base .. ':served10:0')
    and ok('EXPIRE', base .. ':served10:0')
end

-- A counting function for this call: served(job, padded_in, out).
local function service_counter(base)
  local bucket = base .. ':served10:' .. math.floor(tonumber(redis.call('TIME')[1]) / 10)
  return function(job, pin, pout)
    -- whole numbers as '%d' strings, made once (Redis formats a Lua number with '%.17g' each time)
    pin, pout = string.format('%d', pin), string.format('%d', pout)
    redis.call('HINCRBY', base .. ':job:' .. job, 'served_in', pin)
    redis.call('HINCRBY', base .. ':job:' .. job, 'served_out', pout)
    local tenant = redis.call('HGET', base .. ':in:' .. job, 'tenant') or job
    for _, key in ipairs({base .. ':served', bucket}) do
      redis.call('HINCRBY', key, tenant .. ':in', pin)
      redis.call('HINCRBY', key, tenant .. ':out', pout)
    end
    redis.call('EXPIRE', bucket, '120')
  end
end

-- A tenant's output against its limits (lib_fair.lua out_ratio): a batch its claim charged (its stream
-- entry's fields tn and vl, the tenant and the mean limit charged per item) adds the limits of its
-- `written` new results and the output tokens they report to the tenant's sums and to the model's
-- ('#', no tenant's name) in M:vtc_ratio, once per result. What it may run: output_ratio_ok (lib.lua
-- acl_refused's ok). Past RATIO_WINDOW limit tokens both sums are halved: the ratio follows recent work.
local RATIO_WINDOW = 1000000
local function output_ratio_ok(ok, base)
  return ok('HINCRBYFLOAT', base .. ':vtc_ratio') and ok('HSET', base .. ':vtc_ratio')
end

local function count_output_ratio(base, charged, written, out_tokens)
  local limit = tonumber(charged.vl or '')
  if written <= 0 or not charged.tn or not limit then return end
  local rk = base .. ':vtc_ratio'
  out_tokens = string.format('%d', out_tokens)  -- a whole number (add_tokens): as '%.17g' would write it
  for _, who in ipairs({charged.tn, '#'}) do
    local lim = tonumber(redis.call('HINCRBYFLOAT', rk, who .. ':lim', limit * written))
    local out = tonumber(redis.call('HINCRBYFLOAT', rk, who .. ':out', out_tokens))
    if lim > RATIO_WINDOW then redis.call('HSET', rk, who .. ':lim', lim / 2, who .. ':out', out / 2) end
  end
end
