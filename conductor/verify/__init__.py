"""Recompute every counter the conductor keeps from the data it counts, and repair drift.

The conductor decides everything from counters (waiting tokens per model, shape instance and
lane; lane fill and readiness; in-flight and reclaimed items; job counts). ``verify`` reads the
data those counters summarise and returns one row per counter: recorded value, truth, difference.

What is checked, for one model (``M`` = ``cdr:{model}``):

- every lane, a list of item records ``M:lane:S:E:L`` with its parallel token list
  ``M:lanetok:S:E:L``: the token list as long as the lane and each of its tokens equal to the
  input_tokens of the record at the same position (claim.lua packs from the token list without
  reading the records, so a wrong token there mis-packs a batch); the lane's length and the sum
  of its token list against ``M:lanemeta:S:E:L`` items and tokens; the lane's rep bounds its
  longest item; ``M:inst:S:E:lanes`` scores the rep; ``fill`` scores the rep too, for a
  non-empty lane only (absent for an empty one);
  ``ready`` holds exactly the lanes with a full batch;
- every shape instance ``M:inst:S:E``: tokens and items against the sum of its lanes' truth;
  a staged or warming instance is in ``M:staged`` scored with its tokens, no other one is; an
  instance whose indices follow an older config (``idx``, lib.lua) awaits re-derivation by the
  next claim: its fill scores and readiness are noted, not checked;
- the model (``M:intake``, the producer's counters, and ``M:state``, the fleet's): tokens and
  items against the sum of its instances' counters;
  inflight_batches and inflight_items against the group's pending entries (XPENDING) and the
  ``n`` field of each; reclaimed_items against the item records inside the reclaimed list's
  entries, and each entry's token list as long as its records;
  submitted, completed and failed against the sum of its jobs' counters; batch entries that
  are not pending (leaked: nothing would ever retire them);
- every job: ``M:in:J`` submitted against the ids of its registry ``M:in:J:sums``, of its packed
  answered ids and of its store-waiting ids (``M:in:J:stored``);
  ``M:job:J`` completed and failed against the ok and error records of ``M:job:J:results``
  (after retention trimmed them, their sum against the done items); done marks ('d' in
  ``M:job:J:items``) against the number of records.

Each level is checked against the level below, so one wrong counter shows up next to both of
its neighbours (an instance's tokens against its lanes, and the model's tokens against it).

With ``items=True`` it also keeps a ledger of every item id: each queued ('q') item must be in
exactly one place (a lane, a pending batch's list ``M:bat:<k>``, or a reclaimed batch), no done
item may wait in a lane, and nothing waits that no job submitted. That costs memory in proportion
to the items. An item record that does not decode is a finding with or without the ledger.

Reads are bounded: an instance with at most SNAPSHOT entries (with its lanes, metas and
indices), the in-flight and reclaimed sets, each small job, and each level's totals are read in
one MULTI, so those rows compare values of one moment even while scripts run (a MULTI of 10,000
entries is a few ms of server time; with the ledger, the pending batches' item lists join the
in-flight MULTI once their names are known). Bigger ones are read in pages (SCAN, HSCAN, XRANGE,
XPENDING with COUNT, LRANGE of bounded ranges) and are not one snapshot: against a live system such a row, or a
row whose key appeared between two reads (a new shape instance, a changed config), can differ
only because a script ran in between. Run against a quiet system, or re-check:
``verify_confirmed`` reports only rows that differ the same way in two passes (timings and
transient rows seen on a live run: bench/RESULTS.md, "Figures moved from code comments").

``repair`` rewrites counters from the truth: each shape instance (its lanes, metas, indices,
counters and staged score) in one Lua call (lua/repair.lua), then the model's counters (as the
sum of the repaired instances and of the jobs) and the job counters in a WATCH/MULTI transaction
that gives up when a script writes the model's state in between (retried a few times). Before
the counters, ``repair_items`` puts items of orphaned places back: a batch list no pending batch
names (lua/repair_items_batch.lua), a lane of a gone instance (lua/repair_items_lane.lua: to the
reclaimed list, or cleared when they have a result), and items with a result in a live lane
(lua/repair_items_done.lua). Items counted queued that are in no
place, duplicated items and items no job knows stay ledger findings, for a human.
"""

from conductor.redis_contract.packing import pad8
from conductor.verify.checks import Report, Row, verify, verify_confirmed
from conductor.verify.drift import publish_drift, watch_drift
from conductor.verify.repair import Change, repair, repair_items
from conductor.verify.report import cli_verify, render

__all__ = ["Change", "Report", "Row", "cli_verify", "pad8", "publish_drift", "render", "repair", "repair_items",
           "verify", "verify_confirmed", "watch_drift"]
