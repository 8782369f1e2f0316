"""``inspect --verify`` and ``--repair`` for the disk tier (conductor/tier.py).

Checked, for a model with anything in the store: every registered segment's file is there and is
what its index record says (its SHA-1, count, tokens, job and shape: the whole file is read);
``M:intake`` stored_items against the registry marks of stored ids ('s<seq>:<sum>' in each job's
``M:in:J:sums``) and stored_tokens against the index records. With the item ledger, each stored
id is placed in its segment ("store <seq>"), so it is neither lost nor duplicated.

A segment that is missing or damaged is a finding that names its items; ``--repair`` answers
each of them with an error result (lua/fail_stored.lua, code ``store_segment_lost``) and drops
the index record: they count as failed, never silently gone. A store that does not answer is a
note (nothing concluded).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from conductor import keys as K
from conductor import segments as S
from conductor.records import Result, ResultError, json_encoder
from conductor.store import Store, StoreError
from conductor.tier import read_segment

EXAMPLES = 5
ERROR_CODE = "store_segment_lost"


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class BadSegment:
    name: str
    rec: dict[str, str]
    why: str
    ids: list[str]


def _index(r: redis.Redis, mk: K.ModelKeys) -> list[tuple[str, dict[str, str]]]:
    names = [_s(n) for n in r.zrange(mk.segs, 0, -1)]
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(mk.seg(n))
    return [(n, {_s(k): _s(v) for k, v in rec.items()}) for n, rec in zip(names, pipe.execute(), strict=True)
            if rec]


def _stored_ids(r: redis.Redis, mk: K.ModelKeys, jobs: list[str]) -> dict[str, list[tuple[str, str]]]:
    """seq -> [(job, id)] of every id whose registry mark says it waits in a store segment."""
    out: dict[str, list[tuple[str, str]]] = {}
    for job in jobs:
        for iid, mark in r.hscan_iter(mk.job_sums(job), count=1000):
            m = _s(mark)
            if m.startswith("s") and ":" in m:
                out.setdefault(m[1:].split(":", 1)[0], []).append((job, _s(iid)))
    return out


def bad_segments(r: redis.Redis, mk: K.ModelKeys, store: Store | None, jobs: list[str],
                 notes: list[str] | None = None) -> tuple[list[BadSegment], dict[str, list[tuple[str, str]]]]:
    """The registered segments that are missing or damaged, with their items; and every stored id."""
    index = _index(r, mk)
    stored = _stored_ids(r, mk, jobs) if index or _i(r.hget(mk.intake, "stored_items")) else {}
    bad: list[BadSegment] = []
    if store is None:
        if index and notes is not None:
            notes.append(f"{mk.model}: {len(index)} store segment(s) registered; no store given (--store, "
                         "CONDUCTOR_STORE): their files were not checked")
        return bad, stored
    for name, rec in index:
        try:
            read_segment(store, rec)
            continue
        except FileNotFoundError:
            why = "missing from the store"
        except S.BadSegment as e:
            why = f"damaged ({e})"
        except StoreError as e:
            if notes is not None:
                notes.append(f"{mk.model}: store segment {name} not checked: {e}")
            continue
        ids = [iid for job, iid in stored.get(rec.get("seq", ""), []) if job == rec.get("job")]
        bad.append(BadSegment(name, rec, why, ids))
    return bad, stored


def _i(v: Any) -> int:
    try:
        return int(_s(v)) if v is not None else 0
    except ValueError:
        return 0


def check_store(r: redis.Redis, mk: K.ModelKeys, jobs: list[str], report: Any, ledger: Any,
                store: Store | None) -> None:
    """Add the tier's rows, findings and ledger places to a verify Report (conductor/verify.py)."""
    from conductor.verify import Row
    index = _index(r, mk)
    rec_items, rec_tokens = (_i(v) for v in r.hmget(mk.intake, "stored_items", "stored_tokens"))
    if not index and not rec_items and not rec_tokens:
        return
    bad, stored = bad_segments(r, mk, store, jobs, report.notes)
    report.rows.append(Row(mk.model, mk.intake, "stored_items", rec_items, sum(len(v) for v in stored.values()),
                           "state.stored"))
    report.rows.append(Row(mk.model, mk.intake, "stored_tokens", rec_tokens,
                           sum(_i(rec.get("tokens")) for _, rec in index), "state.stored"))
    if ledger is not None:
        for seq, pairs in stored.items():
            for job, iid in pairs:
                ledger.add(job, iid, f"store {seq}")
    for b in bad:
        shown = ", ".join(b.ids[:EXAMPLES]) + (" ..." if len(b.ids) > EXAMPLES else "")
        report.problems.append(
            f"{mk.model}: store segment {b.name} ({b.rec.get('path')}, job {b.rec.get('job')}) is {b.why}: "
            f"{len(b.ids)} item(s) wait in it: {shown} (--repair answers them with an error result)")


def repair_store(r: redis.Redis, model: str, store: Store | None, *, scripts: Any) -> list[str]:
    """Answer the items of every missing or damaged segment with an error result; one line each."""
    mk = K.ModelKeys(model)
    jobs = sorted(_s(j) for j in r.zrange(K.JOBS_KEY, 0, -1)
                  if r.sismember(K.job_models_key(_s(j)), model))
    bad, _ = bad_segments(r, mk, store, jobs)
    out = []
    now = int(time.time() * 1000)
    for b in bad:
        job = b.rec["job"]
        msg = (f"the store segment that held this item ({b.rec.get('path')}) is {b.why}: the item was not run; "
               f"submit it again under another job id")
        args: list[Any] = [b.name]
        for iid in b.ids:
            res = Result(id=iid, model=model, job=job, output="", output_tokens=0,
                         error=ResultError(ERROR_CODE, msg), shape=b.rec.get("sig", ""), epoch=0, lane=-1,
                         batch="", batch_size=0, batch_padded_len=0, input_tokens=0, worker="repair",
                         claimed_at=0, finished_at=now, deliveries=0)
            args += [iid, json_encoder.encode(res)]
        failed, skipped = scripts.fail_stored(
            keys=[mk.intake, mk.state, mk.segs, mk.seg(b.name), mk.job_sums(job), mk.job(job), mk.job_items(job),
                  mk.job_results(job)], args=args)
        out.append(f"store segment {b.name} ({b.why}): {failed} item(s) of job {job} answered with error "
                   f"{ERROR_CODE}" + (f", {skipped} placed meanwhile" if skipped else ""))
    return out
