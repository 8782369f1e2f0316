"""The disk tier's feeder (issue 18): the worker that holds the maintenance lease
(workers/maintenance.py) loads store segments back into the lanes as they drain, under the
model's resident_tokens ceiling. Residency by whole shapes (issue 37): the served (active)
shapes' segments first, up to the ceiling; then, up to the ceiling less the served shapes' reserve
(conductor/tier/spill.py ``reserve``), the warming shape's, then those of the staged shapes that
hold the most, so the shape served next is whole in Redis rather than a slice of every shape;
then the oldest. A served shape thus gets its next segment before its lanes run dry, and the claim
does not drain it while segments of it wait (lua/lib_serve.lua ``awaits_store``).

Lanes and shape instances are assigned when a segment is loaded, by submit.lua's own rule
(conductor/tier/spill.py says why segments are per signature). A feeder that died between
loading a segment and dropping its index record loads it again: submit.lua places each stored id
once, so the second load places nothing.
"""

from __future__ import annotations

import json
import logging
import time

from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.scripts import ScriptClient
from conductor.tier import segments as S
from conductor.tier.object_store import Store
from conductor.tier.spill import ceiling, reserve

log = logging.getLogger("conductor.tier")


class Feeder:
    """The worker's side (the maintenance lease holder): segments back into lanes as they drain."""

    def __init__(self, client: ScriptClient, store: Store, model: str) -> None:
        self.c = client
        self.store = store
        self.mk = K.ModelKeys(model)
        self.loaded_segments = 0
        self.loaded_items = 0
        self.load_s = 0.0  # time spent in load(), for the feed rate (bench/memory/disk_tier.py)
        # whether segments may still wait after the last feed (the lease holder then wakes at the
        # feed interval instead of blocking on the doorbell until its next sweep: workers/maintenance.py)
        self.more = True

    def feed(self, max_segments: int = 64) -> int:
        """Load segments while the lanes have room under the ceiling; the items placed."""
        mk, r = self.mk, self.c.r
        placed = 0
        self.more = True
        for _ in range(max_segments):
            limit = ceiling(r, mk)
            waiting = int(as_str(r.hget(mk.intake, "tokens") or 0))
            if limit > 0 and waiting >= limit:
                break
            pick = self.next_segment()
            if pick is None:
                self.more = False
                break
            name, rec, served = pick
            # Under the ceiling (less the reserve unless the segment is a served shape's), or one
            # segment when the lanes are empty (a segment is at most a quarter of the ceiling it
            # was cut for; a lowered ceiling must not stall the backlog).
            room = limit if served else limit - reserve(limit)
            if limit > 0 and waiting > 0 and waiting + int(rec["tokens"]) > room:
                break
            n = self.load(name, rec)
            if n < 0:
                continue  # a bad segment, marked; the next one
            placed += n
        return placed

    def next_segment(self) -> tuple[str, dict[str, str], bool] | None:
        """The next good segment to load and whether it is a served (active) shape's: the oldest
        of an active shape (found by the shape's own segment index, however many segments wait),
        else of a warming one, else of the staged shape holding the most tokens in Redis that has
        one, else the oldest."""
        mk, r = self.mk, self.c.r
        served = self._served_segment()
        if served is not None:
            return (*served, True)
        names = [as_str(n) for n in r.zrange(mk.segs, 0, 255)]
        if not names:
            return None
        pipe = r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(mk.seg(n))
        pipe.zrange(mk.active, 0, -1)
        pipe.hvals(mk.warming)
        pipe.zrevrange(mk.staged, 0, -1)
        *recs, active, warming, staged = pipe.execute()
        good = [
            (n, {as_str(k): as_str(v) for k, v in rec.items()})
            for n, rec in zip(names, recs, strict=True)
            if rec and b"bad" not in rec
        ]
        # a segment's shape: the signature its items join ('shape', register_segment.lua; a segment
        # registered before it was kept names only its plain signature)
        by_shape: dict[str, tuple[str, dict[str, str]]] = {}
        for n, rec in good:
            by_shape.setdefault(rec.get("shape") or rec["sig"], (n, rec))
        for inst in active:
            hit = by_shape.get(as_str(inst).split(":")[0])
            if hit:
                return (*hit, True)
        for inst in (*warming, *staged):
            hit = by_shape.get(as_str(inst).split(":")[0])
            if hit:
                return (*hit, False)
        return (*good[0], False) if good else None

    def _served_segment(self) -> tuple[str, dict[str, str]] | None:
        """The oldest good segment of an active shape from its index (M:shape:S:segs), or None."""
        mk, r = self.mk, self.c.r
        shapes = list(dict.fromkeys(as_str(i).split(":")[0] for i in r.zrange(mk.active, 0, -1)))
        if not shapes:
            return None
        pipe = r.pipeline(transaction=False)
        for sh in shapes:
            pipe.zrange(mk.shape_segs(sh), 0, 15)  # the first good one among its oldest (bad ones stay listed)
        names = [as_str(n) for ns in pipe.execute() for n in ns]
        if not names:
            return None
        pipe = r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(mk.seg(n))
        for n, rec in zip(names, pipe.execute(), strict=True):
            if rec and b"bad" not in rec:
                return n, {as_str(k): as_str(v) for k, v in rec.items()}
        return None

    def load(self, name: str, rec: dict[str, str]) -> int:
        """One segment into its shape's lanes; the items placed, or -1 when it is missing or
        damaged (then marked bad for `inspect --verify`, and left registered). A store that does
        not answer raises StoreError: nothing is marked."""
        t0 = time.perf_counter()
        try:
            return self._load(name, rec)
        finally:
            self.load_s += time.perf_counter() - t0

    def _load(self, name: str, rec: dict[str, str]) -> int:
        mk = self.mk
        try:
            seg = S.read_segment(self.store, rec)
        except (FileNotFoundError, S.BadSegment) as e:  # a store that fails to answer raises StoreError
            why = "missing" if isinstance(e, FileNotFoundError) else f"{e}"
            self.c.r.hset(mk.seg(name), "bad", why[:500])
            log.error(json.dumps({"event": "segment_bad", "model": mk.model, "segment": name, "error": why}))
            return -1
        # Paused, or Redis full, raise as Paused or QueueFull: the worker's maintenance rides them out.
        placed = sum(1 for lane in calls.load_segment(mk, seg).run(self.c.scripts) if lane >= 0)
        pipe = self.c.r.pipeline(transaction=True)
        pipe.zrem(mk.segs, name)
        if rec.get("shape"):
            pipe.zrem(mk.shape_segs(rec["shape"]), name)
        pipe.delete(mk.seg(name), mk.seg_ids(name))
        pipe.execute()
        self.store.delete(rec["path"])
        self.loaded_segments += 1
        self.loaded_items += placed
        return placed
