-- lib_writeback.lua: complete.lua's results written back, grouped by job: which are new (a done mark
-- or a packed id says an item has its result), then per job its result records, done marks and
-- counters, the service it received (lib_service.lua), a request job's reply lists and the job's end
-- stamp (lib_job_end.lua).
-- Keys: M:job:J:items (HMGET, HSET), M:job:J:packed (lib_packed.lua), M:job:J:results (XADD), M:job:J
--   (HINCRBY), M:reply:J:I (LPUSH, PEXPIRE), M:state (HINCRBY completed, failed); through
--   lib_service.lua and lib_job_end.lua what they touch.
-- Invariants: results_by_job only reads and write_results only writes; a result is written at most
--   once per item (an item already done, or named twice in one call, is skipped), and the counters
--   move with the results written.
--@include lib.lua
--@include lib_job_end.lua
--@include lib_service.lua
--@include lib_packed.lua

-- The n results of argv (4 fields each from argv[4]) by job, in the order jobs first appear: per job
-- g.ids and g.at (each result's id and its position in argv), g.state (its done marks: one HMGET per
-- job, in slices as unpack stops near 8,000 values) and g.ends (lib_job_end.lua; none for a request
-- job, which never ends; g.request says which). Returns jobs, order.
local function results_by_job(base, argv, n)
  local jobs, order = {}, {}
  -- A batch's results are nearly always of one job: the last result's job and table are kept, so a
  -- result of the same job looks nothing up (job names are interned strings: == compares pointers).
  local last, g = nil, nil
  for i = 0, n - 1 do
    local o = 4 + 4 * i
    local job = argv[o]
    if job ~= last then
      g = jobs[job]
      if not g then
        g = {ids = {}, at = {}, state = {}, n = 0}
        jobs[job] = g
        order[#order + 1] = job
      end
      last = job
    end
    -- g.n counts the job's results (the length operator is a search in Lua 5.1, once a result)
    local j = g.n + 1
    g.ids[j], g.at[j], g.n = argv[o + 1], o, j
  end
  for _, job in ipairs(order) do
    local g = jobs[job]
    g.state = done_marks(base .. ':job:' .. job, g.ids)  -- packed ids (lib_packed.lua) are done too
    g.request = is_request(job)
    if not g.request then g.ends = job_end_read(base, job) end
  end
  return jobs, order
end

-- The new results written: per job one HSET of done marks and one HINCRBY per status, not a command
-- per result. Returns how many were written and the output tokens they report.
local function write_results(base, state_key, jobs, order, argv)
  local served = service_counter(base)  -- lib_service.lua
  -- Counts go to Redis as '%d' strings: Redis formats a Lua number argument with '%.17g', three
  -- times the cost for the same digits.
  local fmt = string.format
  local written, done_ok, done_err, out_tokens = 0, 0, 0, 0
  for _, job in ipairs(order) do
    local g, jk = jobs[job], base .. ':job:' .. job
    -- news: the argv positions of the new results, whose tokens add_tokens counts after the loop
    local marks, nm, seen, ok_n, err_n, last, news = {}, 0, {}, 0, 0, nil, {}
    -- numeric loop (ipairs calls its iterator, a C function, once per result); g's fields read once
    local ids, state, at, request = g.ids, g.state, g.at, g.request
    local results_key = jk .. ':results'  -- made once, not concatenated (and interned) once a result
    for j = 1, g.n do
      local id = ids[j]
      if state[j] ~= 'd' and not seen[id] then
        seen[id] = true
        local o = at[j]
        nm = nm + 2
        marks[nm - 1], marks[nm] = id, 'd'
        last = redis.call('XADD', results_key, '*', 'id', id, 'r', argv[o + 3])
        if request then
          local rk = base .. ':reply:' .. job .. ':' .. id
          redis.call('LPUSH', rk, argv[o + 3])
          redis.call('PEXPIRE', rk, RULES.REPLY_TTL_MS)
        end
        if argv[o + 2] == 'ok' then ok_n = ok_n + 1 else err_n = err_n + 1 end
        news[ok_n + err_n] = o
      end
    end
    if ok_n + err_n > 0 then add_tokens(g, argv, news, ok_n + err_n) end
    for s = 1, nm, 2000 do
      redis.call('HSET', jk .. ':items', unpack(marks, s, math.min(s + 1999, nm)))
    end
    if ok_n > 0 then redis.call('HINCRBY', jk, 'completed', fmt('%d', ok_n)) end
    if err_n > 0 then redis.call('HINCRBY', jk, 'failed', fmt('%d', err_n)) end
    if ok_n + err_n > 0 then served(job, g.pin or 0, g.pout or 0) end
    out_tokens = out_tokens + (g.pout or 0)
    if last and g.ends then job_end_stamp(base, job, g.ends, ok_n + err_n, string.match(last, '^%d+')) end
    written, done_ok, done_err = written + ok_n + err_n, done_ok + ok_n, done_err + err_n
  end
  if done_ok > 0 then redis.call('HINCRBY', state_key, 'completed', fmt('%d', done_ok)) end
  if done_err > 0 then redis.call('HINCRBY', state_key, 'failed', fmt('%d', done_err)) end
  return written, out_tokens
end
