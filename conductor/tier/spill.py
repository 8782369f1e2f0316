"""The disk tier (issue 18, seed 002's disk mode): backlogs beyond Redis memory.

With a store (``conductor/tier/object_store.py``) and a model's ``resident_tokens`` ceiling above 0, at most
that many input tokens wait in Redis lanes. Beyond it ``Conductor.submit`` writes the items to
store segments (``conductor/tier/segments.py``: one model, job and shape signature each) and registers
each with lua/register_segment.lua, atomically with the counts. The worker that holds the
maintenance lease feeds segments back through submit.lua as the lanes drain (conductor/tier/feeder.py), under
the ceiling, oldest first with the active shapes' segments before the others.

Segments are per signature, not per lane and epoch: lanes and shape instances are assigned when a
segment is loaded, by submit.lua's own rule, because the lane a new item should join depends on
what is waiting in Redis then (lanes retire, epochs finish, the depth rule counts what waits) and
a segment may wait for hours. Purity is kept: one segment, one shape; a batch is taken from one
instance's lanes as always.

Crash safety: a segment is written whole (the store) and then registered (one script). Died
between the two, the producer's re-run finds the ids unregistered, makes the same segment (its
name derives from its content) and registers it; died after, the re-run finds the ids registered
(in the job's stored ids, M:in:J:stored) and leaves them out. A feeder that died between loading
a segment and dropping its index record loads it again: submit.lua places each stored id once, so
the second load places nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import redis

from conductor.errors import ConductorError
from conductor.redis_contract import keys as K
from conductor.redis_contract import rules
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.item_record import content_sum, record_head
from conductor.redis_contract.packed_ids import known_sums
from conductor.redis_contract.records import PreparedItem
from conductor.tier import segments as S
from conductor.tier.object_store import Store

SEGMENT_ITEMS = rules.MAX_CALL_ITEMS  # one submit.lua call loads a whole segment
MIN_SEGMENT_TOKENS = 1

# Registers a segment, confirmed on replicas when the client waits for them (the client's own
# script call: ConductorCore._confirmed, handed over by the client that owns this Tier).
Register = Callable[[calls.Call[bool]], bool]


def segment_tokens(ceiling: int) -> int:
    """A segment's token size: a quarter of the ceiling, so the feeder tops the lanes up in steps
    and Redis holds at most the ceiling (a single item larger than that travels alone)."""
    return max(MIN_SEGMENT_TOKENS, ceiling // rules.SEGMENT_PARTS)


def reserve(ceiling: int) -> int:
    """The part of the ceiling kept for the served shapes' segments (issue 37): the feeder loads
    other shapes' segments only up to the ceiling less this, so a served shape's next segment finds
    room when its lanes run low (what it leaves in its lanes, under a batch, plus a segment, fits
    in two segments' worth) and the shape is served in one piece, not drained into a padded tail
    and taken up again later. Submit still fills Redis to the ceiling (a first served shape whose
    segment finds no room drains as before: lua/lib_serve.lua awaits_store)."""
    return 2 * segment_tokens(ceiling) if ceiling > 0 else 0


def ceiling(r: redis.Redis, mk: K.ModelKeys) -> int:
    """The model's resident_tokens ceiling; 0 (no tier for it) when unset or unreadable."""
    raw = r.hget(mk.cfg, "resident_tokens")
    try:
        return max(0, int(as_str(raw))) if raw is not None else 0
    except ValueError:
        return 0


class Tier:
    """The producer's side: which items wait in Redis and which go to the store. The client's
    submit asks ``resident_count`` and sends that many items to the lanes itself, then hands the
    rest to ``write_segments``."""

    def __init__(self, r: redis.Redis, store: Store) -> None:
        self.r = r
        self.store = store
        self._writable = False

    def resident_count(self, mk: K.ModelKeys, its: Sequence[PreparedItem]) -> int:
        """How many of ``its`` (grouped by shape) go to Redis lanes now: up to the ceiling, none
        once anything of the model waits in the store (fed items keep their order behind the
        ones stored before), all when the model has no ceiling."""
        limit = ceiling(self.r, mk)
        if limit <= 0:
            return len(its)
        if not self._writable:
            self.store.check_writable()  # StoreError before anything of the call is written
            self._writable = True
        waiting, stored = (int(as_str(v or 0)) for v in self.r.hmget(mk.intake, "tokens", "stored_tokens"))
        k = 0
        if stored == 0:
            room = limit - waiting
            while k < len(its) and its[k].input_tokens <= room:
                room -= its[k].input_tokens
                k += 1
        return k

    def write_segments(
        self,
        mk: K.ModelKeys,
        job: str,
        its: Sequence[PreparedItem],
        register: Register,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[int, int]:
        """``its`` into store segments of at most a quarter of the ceiling each, registered one by
        one; (accepted, duplicates). ``progress(items done)`` after each segment."""
        accepted = duplicates = done = 0
        for piece in _pieces(its, segment_tokens(ceiling(self.r, mk))):
            a, d = self._write_one(mk, job, piece, register)
            accepted, duplicates = accepted + a, duplicates + d
            done += len(piece)
            if progress:
                progress(done)
        return accepted, duplicates

    def _write_one(
        self, mk: K.ModelKeys, job: str, piece: Sequence[PreparedItem], register: Register
    ) -> tuple[int, int]:
        head = record_head(job)
        for _ in range(5):
            # an id the job has (in its registry, a store segment, or answered and packed:
            # conductor/redis_contract/packed_ids.py): the same content (other content was refused
            # before, in submit)
            known = known_sums(self.r, mk, job, [it.id for it in piece])
            fresh = [it for it, had in zip(piece, known, strict=True) if had is None]
            dups = len(piece) - len(fresh)
            if not fresh:
                return 0, dups
            seg = S.build(mk.model, job, fresh)
            data = S.encode(seg)
            self.store.put(seg.file_name, data)  # StoreError: nothing registered
            call = calls.register_segment(
                mk, seg, S.file_sum(data), [it.id for it in fresh], [content_sum(head, it) for it in fresh]
            )
            try:
                registered = register(call)
            except redis.ResponseError as e:
                if str(e).startswith("KNOWN"):
                    continue  # another producer registered some of these meanwhile: look again
                raise
            return (len(fresh), dups) if registered else (0, dups + len(fresh))
        raise ConductorError(f"job {job}: ids kept moving under other producers; nothing more written")


def _pieces(its: Sequence[PreparedItem], max_tokens: int) -> list[Sequence[PreparedItem]]:
    """Runs of one shape, cut at SEGMENT_ITEMS items or ``max_tokens`` tokens."""
    out: list[Sequence[PreparedItem]] = []
    start, tokens = 0, 0
    for i, it in enumerate(its):
        if i > start and (
            it.sig != its[start].sig or i - start >= SEGMENT_ITEMS or tokens + it.input_tokens > max_tokens
        ):
            out.append(its[start:i])
            start, tokens = i, 0
        tokens += it.input_tokens
    if start < len(its):
        out.append(its[start:])
    return out
