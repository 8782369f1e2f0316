"""The disk tier (issue 18, seed 002's disk mode): backlogs beyond Redis memory.

With a store (``conductor/tier/object_store.py``) and a model's ``resident_tokens`` ceiling above 0, at most
that many input tokens wait in Redis lanes. Beyond it ``Conductor.submit`` writes the items to
store segments (``conductor/tier/segments.py``: one model, job and shape signature each) and registers
each with lua/register_segment.lua, atomically with the counts. The worker that holds the
maintenance lease feeds segments back through submit.lua as the lanes drain (``Feeder``), under
the ceiling, oldest first with the active shapes' segments before the others.

Segments are per signature, not per lane and epoch: lanes and shape instances are assigned when a
segment is loaded, by submit.lua's own rule, because the lane a new item should join depends on
what is waiting in Redis then (lanes retire, epochs finish, the depth rule counts what waits) and
a segment may wait for hours. Purity is kept: one segment, one shape; a batch is taken from one
instance's lanes as always.

Crash safety: a segment is written whole (the store) and then registered (one script). Died
between the two, the producer's re-run finds the ids unregistered, makes the same segment (its
name derives from its content) and registers it; died after, the re-run finds the ids registered
and leaves them out. A feeder that died between loading a segment and dropping its index record
loads it again: submit.lua places each stored id once, so the second load places nothing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis

from conductor.errors import ConductorError
from conductor.intake.formats import PreparedItem
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.script_calls import load_args
from conductor.tier import segments as S
from conductor.tier.object_store import Store

if TYPE_CHECKING:
    from conductor.client import Conductor
    from conductor.client.submit_stream import SubmitReport

__all__ = ["Feeder", "Tier", "load_args", "read_segment", "segment_tokens"]

log = logging.getLogger("conductor.tier")

SEGMENT_ITEMS = 5000  # one submit.lua call loads a whole segment
MIN_SEGMENT_TOKENS = 1


def segment_tokens(ceiling: int) -> int:
    """A segment's token size: a quarter of the ceiling, so the feeder tops the lanes up in steps
    and Redis holds at most the ceiling (a single item larger than that travels alone)."""
    return max(MIN_SEGMENT_TOKENS, ceiling // 4)


class Tier:
    """The producer's side: which items wait in Redis and which go to the store."""

    def __init__(self, conductor: Conductor, store: Store) -> None:
        self.c = conductor
        self.store = store
        self._writable = False

    def ceiling(self, mk: K.ModelKeys) -> int:
        raw = self.c.r.hget(mk.cfg, "resident_tokens")
        try:
            return max(0, int(as_str(raw))) if raw is not None else 0
        except ValueError:
            return 0

    def submit_model(self, mk: K.ModelKeys, job: str, its: Sequence[PreparedItem], report: SubmitReport,
                     progress: Callable[[int], None] | None = None) -> None:
        """``its`` (grouped by shape) into Redis lanes up to the ceiling, the rest into segments.
        Once anything of the model waits in the store, everything new goes there too: fed items
        keep their order behind the ones already stored."""
        ceiling = self.ceiling(mk)
        if ceiling <= 0:
            self.c._submit_calls(mk, job, its, report, progress)
            return
        if not self._writable:
            self.store.check_writable()  # StoreError before anything of the call is written
            self._writable = True
        waiting, stored = (int(as_str(v or 0)) for v in self.c.r.hmget(mk.intake, "tokens", "stored_tokens"))
        k = 0
        if stored == 0:
            room = ceiling - waiting
            while k < len(its) and its[k].input_tokens <= room:
                room -= its[k].input_tokens
                k += 1
        if k:
            self.c._submit_calls(mk, job, its[:k], report, progress)
        if k < len(its):
            base = report.accepted + report.duplicates

            def shown(n: int) -> None:
                if progress is not None:
                    progress(base + n)
            self.write_segments(mk, job, its[k:], report, segment_tokens(ceiling), shown if progress else None)

    def write_segments(self, mk: K.ModelKeys, job: str, its: Sequence[PreparedItem], report: SubmitReport,
                       max_tokens: int, progress: Callable[[int], None] | None = None) -> None:
        done = 0
        for piece in _pieces(its, max_tokens):
            self._write_one(mk, job, piece, report)
            done += len(piece)
            if progress:
                progress(done)

    def _write_one(self, mk: K.ModelKeys, job: str, piece: Sequence[PreparedItem], report: SubmitReport) -> None:
        from conductor.client.submit_stream import content_sum
        head = calls.record_head(job)
        sums_key = mk.job_sums(job)
        for _ in range(5):
            known = self.c.r.hmget(sums_key, [it.id for it in piece])
            # an id the job has: the same content (other content was refused before, in submit)
            fresh = [it for it, had in zip(piece, known, strict=True) if had is None]
            dups = len(piece) - len(fresh)
            if not fresh:
                report.duplicates += dups
                return
            seg = S.build(mk.model, job, fresh)
            data = S.encode(seg)
            self.store.put(seg.file_name, data)  # StoreError: nothing registered
            call = calls.register_segment(mk, seg, S.file_sum(data), [it.id for it in fresh],
                                          [content_sum(head, it) for it in fresh])
            try:
                registered = self.c._confirmed(call)
            except redis.ResponseError as e:
                if str(e).startswith("KNOWN"):
                    continue  # another producer registered some of these meanwhile: look again
                raise
            report.duplicates += dups
            if registered:
                report.accepted += len(fresh)
            else:
                report.duplicates += len(fresh)
            return
        raise ConductorError(f"job {job}: ids kept moving under other producers; nothing more written")


def _pieces(its: Sequence[PreparedItem], max_tokens: int) -> list[Sequence[PreparedItem]]:
    """Runs of one shape, cut at SEGMENT_ITEMS items or ``max_tokens`` tokens."""
    out: list[Sequence[PreparedItem]] = []
    start, tokens = 0, 0
    for i, it in enumerate(its):
        if i > start and (it.sig != its[start].sig or i - start >= SEGMENT_ITEMS
                          or tokens + it.input_tokens > max_tokens):
            out.append(its[start:i])
            start, tokens = i, 0
        tokens += it.input_tokens
    if start < len(its):
        out.append(its[start:])
    return out


class Feeder:
    """The worker's side (the maintenance lease holder): segments back into lanes as they drain."""

    def __init__(self, conductor: Conductor, store: Store, model: str) -> None:
        self.c = conductor
        self.store = store
        self.mk = K.ModelKeys(model)
        self.loaded_segments = 0
        self.loaded_items = 0
        self.load_s = 0.0  # time spent in load(), for the feed rate (bench/disk_tier.py)
        # whether segments may still wait after the last feed (the lease holder then wakes at the
        # feed interval instead of blocking on the doorbell until its next sweep: workers/maintenance.py)
        self.more = True

    def feed(self, max_segments: int = 64) -> int:
        """Load segments while the lanes have room under the ceiling; the items placed."""
        mk, r = self.mk, self.c.r
        placed = 0
        self.more = True
        for _ in range(max_segments):
            ceiling = Tier(self.c, self.store).ceiling(mk)
            waiting = int(as_str(r.hget(mk.intake, "tokens") or 0))
            if ceiling > 0 and waiting >= ceiling:
                break
            pick = self.next_segment()
            if pick is None:
                self.more = False
                break
            name, rec = pick
            # Under the ceiling, or one segment when the lanes are empty (a segment is at most a
            # quarter of the ceiling it was cut for; a lowered ceiling must not stall the backlog).
            if ceiling > 0 and waiting > 0 and waiting + int(rec["tokens"]) > ceiling:
                break
            n = self.load(name, rec)
            if n < 0:
                continue  # a bad segment, marked; the next one
            placed += n
        return placed

    def next_segment(self) -> tuple[str, dict[str, str]] | None:
        """The oldest good segment of an active shape, else of a warming one, else the oldest."""
        mk, r = self.mk, self.c.r
        names = [as_str(n) for n in r.zrange(mk.segs, 0, 255)]
        if not names:
            return None
        pipe = r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(mk.seg(n))
        pipe.zrange(mk.active, 0, -1)
        pipe.hvals(mk.warming)
        *recs, active, warming = pipe.execute()
        active_sigs = {as_str(i).split(":")[0] for i in active}
        warming_sigs = {as_str(i).split(":")[0] for i in warming}
        good = [(n, {as_str(k): as_str(v) for k, v in rec.items()}) for n, rec in zip(names, recs, strict=True)
                if rec and b"bad" not in rec]
        for sigs in (active_sigs, warming_sigs):
            for n, rec in good:
                if rec["sig"] in sigs:
                    return n, rec
        return good[0] if good else None

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
            seg = read_segment(self.store, rec)
        except (FileNotFoundError, S.BadSegment) as e:  # a store that fails to answer raises StoreError
            why = "missing" if isinstance(e, FileNotFoundError) else f"{e}"
            self.c.r.hset(mk.seg(name), "bad", why[:500])
            log.error(json.dumps({"event": "segment_bad", "model": mk.model, "segment": name, "error": why}))
            return -1
        # Paused, or Redis full, raise as Paused or QueueFull: the worker's maintenance rides them out.
        placed = sum(1 for lane in calls.load_segment(mk, seg).run(self.c.scripts) if lane >= 0)
        pipe = self.c.r.pipeline(transaction=True)
        pipe.zrem(mk.segs, name)
        pipe.delete(mk.seg(name))
        pipe.execute()
        self.store.delete(rec["path"])
        self.loaded_segments += 1
        self.loaded_items += placed
        return placed


def read_segment(store: Store, rec: dict[str, str]) -> S.Segment:
    """The segment an index record names, checked against the record (sum, count, tokens)."""
    data = store.get(rec["path"])
    if S.file_sum(data) != rec["sum"]:
        raise S.BadSegment(f"segment {rec['path']} is damaged: its SHA-1 is not the registered one")
    seg = S.decode(data)
    if len(seg.records) != int(rec["items"]) or sum(seg.tokens) != int(rec["tokens"]) or seg.job != rec["job"] \
            or seg.sig != rec["sig"]:
        raise S.BadSegment(f"segment {rec['path']} does not hold what its index record says")
    return seg
