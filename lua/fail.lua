#!lua flags=allow-oom
-- allow-oom: at maxmemory a full Redis must still drain (this script frees or moves memory); only
-- submit.lua is refused, with QueueFull.
-- fail.lua: a worker gives back a batch it could not run (engine error), to retry or dead-letter.
--
-- KEYS[1] base       cdr:{model}
-- KEYS[2] cfg        cdr:{model}:cfg
-- KEYS[3] state      cdr:{model}:state
-- KEYS[4] batches    cdr:{model}:batches   (group "workers")
-- KEYS[5] reclaimed  cdr:{model}:reclaimed
-- ARGV[1] batch_id   the pending batch
-- ARGV[2] consumer   the worker giving it back (must own it)
-- ARGV[3] reason     the error, kept with a dead-lettered item
-- Returns: {items requeued, items dead-lettered}; {0, 0} when the batch was not pending for
--   this consumer (already completed, failed or reclaimed).
--   Errors, with nothing written: 'ERR_ARG <field>: ...'; 'NOPERM ...' when the caller's ACL
--   refuses a command this call may run (lib.lua acl_refused); 'ERR_STATE ...' when an item record
--   of the batch does not decode; 'PAUSED ...'.
-- Invariants: the same as reclaim.lua: nothing with a result is redone, an item is delivered at
--   most max_deliveries times, then dead-lettered with a failed result so its job completes.
-- While the model is paused (conductor pause) it refuses with 'PAUSED ...', nothing written.
--@include lib.lua
--@include lib_requeue_prologue.lua

local batches_key = KEYS[4]
local bid, consumer, reason = ARGV[1], ARGV[2], ARGV[3] or ''
local bad = batch_ref_bad(bid, consumer)
if bad then return bad end
if #reason > RULES.MAX_REASON_BYTES then reason = string.sub(reason, 1, RULES.MAX_REASON_BYTES) end
local rq, refused = requeue_prologue(KEYS)
if not rq then return refused end
local p = redis.call('XPENDING', batches_key, GROUP, bid, bid, 1, consumer)
if #p == 0 then return {0, 0} end
local plan, err = requeue_plan(rq, bid, reason, true)
if not plan then return err end
local k, d = requeue_apply(rq, plan)
return {k, d}
