"""What each counter counts, read from the data: a shape instance's lanes, the in-flight and
reclaimed batches, orphaned batch lists, a job's items and results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.verify.ledger import Ledger, decode_rec, ledger_records
from conductor.verify.snapshot import (
    EXAMPLES,
    LIST_PAGE,
    PAGE,
    PENDING_PAGE,
    SNAPSHOT,
    Snapshot,
    as_int,
    lane_pages,
    list_pages,
    pairs,
    read_zset,
    xrange_pages,
)

_blob_decoder = msgspec.msgpack.Decoder()


class _ResultStatus(msgspec.Struct):
    id: str
    error: Any = None


_result_decoder = msgspec.json.Decoder(_ResultStatus)


@dataclass
class LaneTruth:
    """One lane's truth: items from its record list, tokens and the longest from its token list
    (what claim.lua packs from and lua/repair.lua recounts)."""

    items: int = 0
    tok_len: int = 0
    tokens: int = 0
    max_tok: int = 0
    # positions whose token differs from the record's input_tokens: (index, token, record's)
    bad: list[tuple[int, int, int]] = field(default_factory=list)
    n_bad: int = 0
    unreadable: int = 0


@dataclass
class InstRead:
    """What one shape instance holds; ``atomic`` when it was read in one MULTI (a snapshot)."""

    ih: dict[str, str]
    lanes_z: dict[str, float]
    fill: dict[str, float]
    ready: dict[str, float]
    free: set[str]
    staged_score: float | None
    lanes: dict[str, tuple[LaneTruth, list[Any]]]  # lane id -> (truth, meta items/tokens/rep)
    atomic: bool


def lane_truth(pages: Any, inst: str, lane: str, ledger: Ledger | None) -> LaneTruth:
    """``pages``: (records, tokens) pairs of the lane and its token list, in order."""
    t = LaneTruth()
    for recs, toks in pages:
        base = t.items
        for raw in toks:
            tok = as_int(raw)
            t.tok_len += 1
            t.tokens += tok
            t.max_tok = max(t.max_tok, tok)
        for j, raw in enumerate(recs):
            t.items += 1
            rec = decode_rec(raw)
            if rec is None:
                t.unreadable += 1
                continue
            if j < len(toks) and as_int(toks[j]) != rec.input_tokens:
                t.n_bad += 1
                if len(t.bad) < EXAMPLES:
                    t.bad.append((base + j, as_int(toks[j]), rec.input_tokens))
            if ledger is not None:
                ledger.add(rec.job, rec.id, f"lane {inst}:{lane}")
    return t


def read_instance(r: redis.Redis, mk: K.ModelKeys, inst: str, scanned: set[str],
                   ledger: Ledger | None) -> InstRead:
    """One MULTI per instance when it holds at most SNAPSHOT entries (each row then compares values
    of one moment, even on a live system); bounded pages otherwise."""
    ik = mk.inst(inst)
    # A lane opened between the two reads sends it round again; under steady intake that can take
    # a few rounds, and falling back to pages would report a moment's drift.
    for _attempt in range(20):
        pipe = r.pipeline(transaction=False)
        for z in (mk.inst_lanes(inst), mk.inst_fill(inst), mk.inst_ready(inst)):
            pipe.zrange(z, 0, -1)
        ids = sorted({as_str(x) for got in pipe.execute() for x in got} | scanned, key=int)
        pipe = r.pipeline(transaction=False)
        for lane in ids:
            pipe.llen(mk.lane(inst, lane))
            pipe.llen(mk.lane_tok(inst, lane))
        if sum(pipe.execute()) > 2 * SNAPSHOT:
            break
        snap = Snapshot(r)
        snap.hgetall(ik)
        for z in (mk.inst_lanes(inst), mk.inst_fill(inst), mk.inst_ready(inst)):
            snap.zrange(z, 0, -1, withscores=True)
        snap.smembers(mk.inst_free(inst))
        snap.zscore(mk.staged, inst)
        for lane in ids:
            # Bounded even if the lanes grew since LLEN: a lane cut at SNAPSHOT + 1 entries
            # pushes the sum over the limit below, and the instance is read again.
            snap.lrange(mk.lane(inst, lane), 0, SNAPSHOT)
            snap.lrange(mk.lane_tok(inst, lane), 0, SNAPSHOT)
            snap.hmget(mk.lanemeta(inst, lane), ["items", "tokens", "rep"])
        res = snap.execute()
        lanes_z, fill, ready = ({as_str(m): float(sc) for m, sc in z} for z in res[1:4])
        if not (set(lanes_z) | set(fill) | set(ready)) <= set(ids):
            continue  # a lane opened between the two reads: read again
        if sum(len(res[6 + 3 * i]) + len(res[7 + 3 * i]) for i in range(len(ids))) > 2 * SNAPSHOT:
            continue  # grew past the snapshot size meanwhile (and may be cut): read again
        lanes = {}
        for i, lane in enumerate(ids):
            recs, toks, meta = res[6 + 3 * i], res[7 + 3 * i], res[8 + 3 * i]
            lanes[lane] = (lane_truth([(recs, toks)], inst, lane, ledger), meta)
        return InstRead({as_str(k): as_str(v) for k, v in res[0].items()}, lanes_z, fill, ready,
                         {as_str(x) for x in res[4]}, None if res[5] is None else float(res[5]), lanes, True)
    ih = {as_str(k): as_str(v) for k, v in r.hgetall(ik).items()}
    lanes_z = read_zset(r, mk.inst_lanes(inst))
    fill = read_zset(r, mk.inst_fill(inst))
    ready = read_zset(r, mk.inst_ready(inst))
    free = {as_str(x) for x in r.sscan_iter(mk.inst_free(inst), count=PAGE)}
    lanes = {}
    for lane in sorted(set(lanes_z) | set(fill) | set(ready) | scanned, key=int):
        t = lane_truth(lane_pages(r, mk, inst, lane), inst, lane, ledger)
        lanes[lane] = (t, r.hmget(mk.lanemeta(inst, lane), ["items", "tokens", "rep"]))
    staged_score = r.zscore(mk.staged, inst)
    return InstRead(ih, lanes_z, fill, ready, free, None if staged_score is None else float(staged_score),
                     lanes, False)


def find_orphans(r: redis.Redis, mk: K.ModelKeys, tokens: set[str]) -> dict[str, tuple[str, dict[bytes, bytes]] | None]:
    """Batch item lists (of the tokens a SCAN found) that no pending batch names, each with the
    batches entry that names its token when one is left (not pending: leaked), else None. The
    pending list is read after the SCAN, and a list a completion deleted meanwhile is skipped."""
    if not tokens:
        return {}
    _b, _n, pending, _bad = read_pending(r, mk, None)
    by_token: dict[str, tuple[str, dict[bytes, bytes]]] = {}
    for eid, f in xrange_pages(r, mk.batches):
        if f.get(b"k"):
            by_token[as_str(f[b"k"])] = (as_str(eid), f)
    out: dict[str, tuple[str, dict[bytes, bytes]] | None] = {}
    for token in sorted(tokens):
        named = by_token.get(token)
        if named is not None and named[0] in pending:
            continue
        if r.exists(mk.batch_items(token)):
            out[token] = named
    return out


def reclaimed_entry(blob: bytes, ledger: Ledger | None) -> tuple[int, int, int]:
    """One reclaimed entry, msgpack [sig, epoch, lane, deliveries, [tokens], [item records]]:
    (records, tokens, unreadable); the records go to the ledger."""
    try:
        e = _blob_decoder.decode(blob)
        toks, recs = e[4], e[5]
        if not isinstance(toks, list) or not isinstance(recs, list):
            raise TypeError
    except (msgspec.DecodeError, IndexError, KeyError, TypeError):
        return 0, 0, 1
    bad = ledger_records(recs, "reclaimed", ledger) if ledger is not None else 0
    return len(recs), len(toks), bad


def read_inflight(r: redis.Redis, mk: K.ModelKeys, ledger: Ledger | None) -> dict[str, int]:
    """One MULTI when the pending list, the batches stream and the reclaimed list are small
    (they hold what workers have in hand, not the backlog); with the ledger that MULTI also reads
    the pending batches' item lists, whose names (field k) a first read learns. Bounded pages
    otherwise."""
    known: list[str] = []  # k of the batches whose item lists the next MULTI reads
    out: dict[str, int] = {}
    for _attempt in range(3):
        pipe = Snapshot(r)
        pipe.hmget(mk.state, ["inflight_batches", "inflight_items", "reclaimed_items"])
        pipe.xpending_range(mk.batches, K.GROUP, min="-", max="+", count=SNAPSHOT + 1)
        pipe.xrange(mk.batches, count=SNAPSHOT + 1)
        pipe.lrange(mk.reclaimed, 0, SNAPSHOT)
        for k in known:
            pipe.lrange(mk.batch_items(k), 0, SNAPSHOT)
        res = _replies(pipe.execute(raise_on_error=False))
        st, pend, entries, blobs = res[:4]
        out = {"recorded_batches": as_int(st[0]), "recorded_items": as_int(st[1]), "recorded_reclaimed": as_int(st[2])}
        if len(pend) > SNAPSHOT or len(entries) > SNAPSHOT or len(blobs) > SNAPSHOT:
            break
        pending = {as_str(p["message_id"]) for p in pend}
        items = sum(as_int(f.get(b"n")) for eid, f in entries if as_str(eid) in pending)
        # (batch id, k) of each pending batch that names its item list
        ks = [(as_str(eid), as_str(f[b"k"])) for eid, f in entries if as_str(eid) in pending and f.get(b"k")]
        bad = 0
        if ledger is not None:
            if items > SNAPSHOT:
                break
            lists = dict(zip(known, res[4:], strict=True))
            if any(k not in lists for _bid, k in ks):
                known = [k for _bid, k in ks]
                continue  # a batch whose list this MULTI did not read: read again with it
            for bid, k in ks:
                bad += ledger_records(lists[k], f"batch {bid}", ledger)
        reclaimed = reclaimed_tok = 0
        for blob in blobs:
            n_rec, n_tok, n_bad = reclaimed_entry(blob, ledger)
            reclaimed += n_rec
            reclaimed_tok += n_tok
            bad += n_bad
        out.update(batches=len(pending), items=items, reclaimed=reclaimed, reclaimed_tokens=reclaimed_tok,
                   unreadable=bad, leaked=sum(1 for eid, _f in entries if as_str(eid) not in pending))
        return out
    batches, items, pending, bad = read_pending(r, mk, ledger)
    reclaimed, reclaimed_tok, bad_r = read_reclaimed(r, mk, ledger)
    out.update(batches=batches, items=items, reclaimed=reclaimed, reclaimed_tokens=reclaimed_tok,
               unreadable=bad + bad_r,
               leaked=sum(1 for eid, _f in xrange_pages(r, mk.batches) if as_str(eid) not in pending))
    return out


def _replies(res: list[Any]) -> list[Any]:
    """The in-flight MULTI's replies; a missing group reads as no pending entry, any other error raises."""
    if isinstance(res[1], Exception):
        if "NOGROUP" not in str(res[1]):
            raise res[1]
        res[1] = []
    for x in (res[0], *res[2:]):
        if isinstance(x, Exception):
            raise x
    return res


def read_pending(r: redis.Redis, mk: K.ModelKeys, ledger: Ledger | None) -> tuple[int, int, set[str], int]:
    """Pending batches in pages: (batches, items, their ids, unreadable item records)."""
    ids: set[str] = set()
    items = bad = 0
    start = "-"
    while True:
        try:
            page = r.xpending_range(mk.batches, K.GROUP, min=start, max="+", count=PENDING_PAGE)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                return 0, 0, ids, 0
            raise
        if not page:
            break
        pipe = r.pipeline(transaction=False)
        for p in page:
            pipe.xrange(mk.batches, min=p["message_id"], max=p["message_id"])
        for p, entry in zip(page, pipe.execute(), strict=True):
            bid = as_str(p["message_id"])
            ids.add(bid)
            if not entry:
                continue  # a pending entry whose message was deleted counts no items
            f = entry[0][1]
            items += as_int(f.get(b"n"))
            if ledger is not None and f.get(b"k"):
                bad += ledger_records(list_pages(r, mk.batch_items(as_str(f[b"k"]))), f"batch {bid}", ledger)
        if len(page) < PENDING_PAGE:
            break
        start = "(" + as_str(page[-1]["message_id"])
    return len(ids), items, ids, bad


def read_reclaimed(r: redis.Redis, mk: K.ModelKeys, ledger: Ledger | None) -> tuple[int, int, int]:
    """The reclaimed list in pages: (item records, tokens, unreadable)."""
    n = n_tok = bad = 0
    i = 0
    while True:
        page: Any = r.lrange(mk.reclaimed, i, i + LIST_PAGE - 1)
        for blob in page:
            n_rec, t, b = reclaimed_entry(blob, ledger)
            n += n_rec
            n_tok += t
            bad += b
        if len(page) < LIST_PAGE:
            return n, n_tok, bad
        i += LIST_PAGE


def job_truth(r: redis.Redis, mk: K.ModelKeys, job: str, ledger: Ledger | None) -> dict[str, int]:
    """A job's counters and their truth. A job of at most SNAPSHOT items and results is read in one
    MULTI; a bigger one counts results up to the last id of a snapshot of its counters, so only
    its id registry (M:in:J:sums) and done marks (M:job:J:items) are read while they may move."""
    fields = ["completed", "failed"]
    pipe = Snapshot(r)
    pipe.hget(mk.job_intake(job), "submitted")
    pipe.hmget(mk.job(job), fields)
    pipe.hlen(mk.job_sums(job))
    pipe.xlen(mk.job_results(job))
    pipe.xrevrange(mk.job_results(job), count=1)
    # answered ids compacted out of the registry and the done marks (lua/compact_ids.lua): counted
    # in both, named in neither (the ledger asks the packed form about an id it cannot place); read
    # in the same snapshot as the registry, which they leave in one step
    pipe.hget(mk.job_packed(job), "n")
    # ids waiting in store segments (schema 6: M:in:J:stored, not the registry): submitted, not
    # done; named by their segments' id lists (tier_truth.py), read here in the same snapshot
    pipe.hget(mk.job_stored(job), "n")
    rec_sub, rec, n_items, n_results, last, raw_packed, raw_stored = pipe.execute()
    registry: Any
    marks: Any
    records: Any
    if n_items <= SNAPSHOT and n_results <= SNAPSHOT:
        pipe = Snapshot(r)
        pipe.hget(mk.job_intake(job), "submitted")
        pipe.hmget(mk.job(job), fields)
        pipe.hkeys(mk.job_sums(job))
        pipe.hgetall(mk.job_items(job))
        pipe.xrange(mk.job_results(job))
        pipe.hget(mk.job_packed(job), "n")
        pipe.hget(mk.job_stored(job), "n")
        rec_sub, rec, registry, marks, records, raw_packed, raw_stored = pipe.execute()
        marks = pairs(marks)
        # fields as a dict on either client (Snapshot parses a cluster MULTI's replies); pairs() takes a flat list too
        records = [(eid, dict(pairs(f))) for eid, f in records]
    else:
        registry = (k for k, _v in r.hscan_iter(mk.job_sums(job), count=PAGE))
        marks = r.hscan_iter(mk.job_items(job), count=PAGE)
        records = xrange_pages(r, mk.job_results(job), upto=as_str(last[0][0]) if last else None) if last else []
    n_packed = as_int(raw_packed)
    if ledger is not None and n_packed:
        ledger.packed[job] = (r, mk, n_packed)
    submitted = done = 0
    for iid in registry:
        submitted += 1
        if ledger is not None:
            ledger.state[(job, as_str(iid))] = "q"
    for iid, st in marks:
        if as_str(st) == "d":
            done += 1
            if ledger is not None:
                ledger.state[(job, as_str(iid))] = "d"
    ok, err, results, dup = _count_records(records, ledger is not None)
    if n_items > SNAPSHOT or n_results > SNAPSHOT:
        submitted = n_items  # the snapshot's count, not the pages'
    submitted, done = submitted + n_packed + as_int(raw_stored), done + n_packed
    # Fewer records than done items: retention trimmed the job's results (conductor/jobs/retention.py),
    # so the ok/error split of the trimmed ones is gone. (A lost record looks the same.)
    return {"submitted": submitted, "completed": ok, "failed": err, "done": done, "results": results,
            "dup_results": dup, "trimmed": results < done,
            "rec_submitted": as_int(rec_sub), "rec_completed": as_int(rec[0]), "rec_failed": as_int(rec[1])}


def _count_records(records: Any, find_dups: bool) -> tuple[int, int, int, int]:
    """A job's result records counted: (ok, error, all, duplicated ids when ``find_dups``)."""
    ok = err = results = dup = 0
    seen: set[str] = set()
    for _eid, f in records:
        results += 1
        try:
            res = _result_decoder.decode(f.get(b"r", b""))
        except msgspec.DecodeError:
            err += 1  # an unreadable record is no success
            continue
        if res.error is None:
            ok += 1
        else:
            err += 1
        if find_dups:
            if res.id in seen:
                dup += 1
            seen.add(res.id)
    return ok, err, results, dup
