"""``inspect --verify`` and ``--repair`` for the disk tier (conductor/tier/spill.py).

Checked, for a model with anything in the store: every registered segment's file is there and is
what its index record says (its SHA-1, count, tokens, job and shape: the whole file is read);
``M:intake`` stored_items against the ids that wait in the store (each segment's id list,
``M:seg:N:ids``, the ones its job's stored ids ``M:in:J:stored`` still hold) and stored_tokens
against the index records, and each shape's stored tokens (``M:shape:S`` stored_tokens, which the
claim reads to keep a served shape in one piece, issue 37) against its index records (those that
name their shape: a segment registered before shapes kept the count names none). With the item ledger, each stored
id is placed in its segment ("store <seq>"), so it is neither lost nor duplicated (the rows,
findings and ledger places: ``checks.py``, ``_Check.store``).

A segment that is missing or damaged is a finding that names its items; ``--repair`` answers
each of them with an error result (lua/fail_stored.lua, code ``store_segment_lost``) and drops
the index record: they count as failed, never silently gone. A store that does not answer is a
note (nothing concluded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.packed_ids import stored_sums
from conductor.redis_contract.records import Result, ResultError, json_encoder
from conductor.redis_contract.scripts import Scripts
from conductor.tier import segments as S
from conductor.tier.object_store import Store, StoreError
from conductor.verify.snapshot import as_int

EXAMPLES = 5
ERROR_CODE = "store_segment_lost"


@dataclass
class LostSegment:
    """A registered segment whose file is missing or damaged (its items cannot be fed): the
    finding, with the ids it holds. The error its read raised is tier.segments.BadSegment."""

    name: str
    rec: dict[str, str]
    why: str
    ids: list[str]


@dataclass
class StoreTruth:
    """What the counters of the disk tier count: the index records and the registry marks."""

    rec_items: int  # M:intake stored_items
    rec_tokens: int  # M:intake stored_tokens
    index: list[tuple[str, dict[str, str]]]  # registered segments: name -> index record
    stored: dict[str, list[tuple[str, str]]]  # seq -> [(job, id)] of ids marked as stored
    # shape -> (M:shape:S stored_tokens, members of M:shape:S:segs)
    rec_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    bad: list[LostSegment] = field(default_factory=list)

    @property
    def items(self) -> int:
        return sum(len(v) for v in self.stored.values())

    @property
    def tokens(self) -> int:
        return sum(as_int(rec.get("tokens")) for _, rec in self.index)

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """shape -> the tokens and the number of the index records that name it."""
        out: dict[str, tuple[int, int]] = {}
        for _, rec in self.index:
            if rec.get("shape"):
                tok, n = out.get(rec["shape"], (0, 0))
                out[rec["shape"]] = (tok + as_int(rec.get("tokens")), n + 1)
        return out


def _index(r: redis.Redis, mk: K.ModelKeys) -> list[tuple[str, dict[str, str]]]:
    names = [as_str(n) for n in r.zrange(mk.segs, 0, -1)]
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(mk.seg(n))
    return [
        (n, {as_str(k): as_str(v) for k, v in rec.items()}) for n, rec in zip(names, pipe.execute(), strict=True) if rec
    ]


def _shape_counts(
    r: redis.Redis, mk: K.ModelKeys, index: list[tuple[str, dict[str, str]]]
) -> dict[str, tuple[int, int]]:
    """shape -> its recorded stored tokens and the size of its segment index (M:shape:S:segs), for
    every shape an index record names and every shape that holds a count above 0 or an index (one
    left with no segment is drift: the claim would wait for it; a count fed down to 0 stays, as 0)."""
    named = {rec["shape"] for _, rec in index if rec.get("shape")}
    shapes = set(named)
    for k in r.scan_iter(match=mk.shape("*"), count=1000):
        shapes.add(as_str(k)[len(mk.shape("")) :].removesuffix(":segs"))
    names = sorted(shapes)
    pipe = r.pipeline(transaction=False)
    for s in names:
        pipe.hget(mk.shape(s), "stored_tokens")
        pipe.zcard(mk.shape_segs(s))
    got = pipe.execute()
    out = {s: (as_int(got[2 * i]), int(got[2 * i + 1])) for i, s in enumerate(names)}
    return {s: v for s, v in out.items() if v[0] or v[1] or s in named}


def _stored_ids(
    r: redis.Redis, mk: K.ModelKeys, index: list[tuple[str, dict[str, str]]]
) -> dict[str, list[tuple[str, str]]]:
    """seq -> [(job, id)] of every id that waits in a store segment: named in the segment's id list
    and still held by its job's stored ids (an id placed in a lane has left them; its segment's
    record goes right after). Every registered segment counts, whatever job it holds: the counters
    do, and a job made after the caller listed the jobs (a submit beside) is no drift."""
    out: dict[str, list[tuple[str, str]]] = {}
    for name, rec in index:
        job = rec.get("job", "")
        ids = [as_str(i) for i in r.lrange(mk.seg_ids(name), 0, -1)]
        held = stored_sums(r, mk, job, ids)
        out.setdefault(rec.get("seq", ""), []).extend((job, i) for i, s in zip(ids, held, strict=True) if s is not None)
    return out


def store_truth(
    r: redis.Redis, mk: K.ModelKeys, store: Store | None, notes: list[str] | None = None
) -> StoreTruth | None:
    """The tier's counters and their truth, with the missing or damaged segments (their files are
    read when ``store`` is given); None when nothing of the model is or was counted in the store."""
    # The index, the ids and the counters are separate reads: a segment registered, fed or failed
    # between them (a submit or a feeder running beside) would read as drift. Every such step moves
    # the counters, so the reads count when the counters did not move across them.
    for _ in range(10):
        counted = r.hmget(mk.intake, "stored_items", "stored_tokens")
        index = _index(r, mk)
        stored = _stored_ids(r, mk, index)
        shapes = _shape_counts(r, mk, index)
        if r.hmget(mk.intake, "stored_items", "stored_tokens") == counted:
            break
        time.sleep(0.05)
    rec_items, rec_tokens = (as_int(v) for v in counted)
    if not index and not rec_items and not rec_tokens and not any(shapes.values()):
        return None
    truth = StoreTruth(rec_items, rec_tokens, index, stored, shapes)
    if store is None:
        if index and notes is not None:
            notes.append(
                f"{mk.model}: {len(index)} store segment(s) registered; no store given (--store, "
                "CONDUCTOR_STORE): their files were not checked"
            )
        return truth
    for name, rec in index:
        why = _damage(store, name, rec, mk, notes)
        if why:
            ids = [iid for job, iid in truth.stored.get(rec.get("seq", ""), []) if job == rec.get("job")]
            truth.bad.append(LostSegment(name, rec, why, ids))
    return truth


def _damage(store: Store, name: str, rec: dict[str, str], mk: K.ModelKeys, notes: list[str] | None) -> str:
    """Why a segment's file is not what its index record says ('' when it is, or when the store
    did not answer: then a note)."""
    try:
        S.read_segment(store, rec)
        return ""
    except FileNotFoundError:
        return "missing from the store"
    except S.BadSegment as e:
        return f"damaged ({e})"
    except StoreError as e:
        if notes is not None:
            notes.append(f"{mk.model}: store segment {name} not checked: {e}")
        return ""


def repair_store(r: redis.Redis, model: str, store: Store | None) -> list[str]:
    """Answer the items of every missing or damaged segment with an error result; one line each."""
    mk = K.ModelKeys(model)
    truth = store_truth(r, mk, store)
    if truth is None or store is None:
        return []
    scripts = Scripts(r)
    out = []
    now = int(time.time() * 1000)
    for b in truth.bad:
        job = b.rec["job"]
        msg = (
            f"the store segment that held this item ({b.rec.get('path')}) is {b.why}: the item was not run; "
            f"submit it again under another job id"
        )
        answers = [
            (
                iid,
                json_encoder.encode(
                    Result(
                        id=iid,
                        model=model,
                        job=job,
                        output="",
                        output_tokens=0,
                        error=ResultError(ERROR_CODE, msg),
                        shape=b.rec.get("sig", ""),
                        epoch=0,
                        lane=-1,
                        batch="",
                        batch_size=0,
                        batch_padded_len=0,
                        input_tokens=0,
                        worker="repair",
                        claimed_at=0,
                        finished_at=now,
                        deliveries=0,
                    )
                ),
            )
            for iid in b.ids
        ]
        failed, skipped = calls.fail_stored(mk, b.name, job, answers).run(scripts)
        out.append(
            f"store segment {b.name} ({b.why}): {failed} item(s) of job {job} answered with error "
            f"{ERROR_CODE}" + (f", {skipped} placed meanwhile" if skipped else "")
        )
    return out
