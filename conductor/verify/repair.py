"""Repair: orphaned items put back (lua/repair_items_*.lua), each shape instance rewritten from its
lanes (lua/repair.lua), then the model's and jobs' counters from the truth in one WATCH/MULTI."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from conductor.errors import ConductorError
from conductor.redis_contract import keys as K
from conductor.redis_contract import rules
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.scripts import Scripts
from conductor.verify.checks import verify
from conductor.verify.snapshot import FoundKeys, as_int, classify, read_zset, xrange_pages
from conductor.verify.truth import find_orphans, job_truth, read_pending, read_reclaimed


@dataclass(frozen=True)
class Change:
    key: str
    field: str
    old: str
    new: str


def repair(r: redis.Redis, model: str, *, attempts: int = 5) -> tuple[list[Change], list[str]]:
    """Rewrite ``model``'s counters from the truth. Returns (changes made, what could not be done)."""
    mk = K.ModelKeys(model)
    scripts = Scripts(r)
    changes, failed = repair_items(r, model)
    found = classify(r, mk)
    staged = read_zset(r, mk.staged)
    for inst in sorted(found.insts | set(found.lanes) | set(staged)):
        extra = sorted(found.lanes.get(inst, set()), key=int)
        try:
            out = calls.repair(mk, inst, extra).run(scripts)
        except (redis.ResponseError, ConductorError) as e:
            failed.append(f"{mk.inst(inst)}: {e}")
            continue
        changes += [Change(*x) for x in out]
    for _ in range(attempts):
        try:
            changes += _repair_model(r, mk)
            break
        except redis.WatchError:
            time.sleep(0.05)
    else:
        failed.append(f"{mk.state}: the model's state kept changing during {attempts} attempts; "
                      "model and job counters not repaired (retry on a quieter system)")
    return changes, failed


def repair_items(r: redis.Redis, model: str) -> tuple[list[Change], list[str]]:
    """Items put back where they belong (one orphaned place per call of lua/repair_items_batch.lua,
    repair_items_lane.lua or repair_items_done.lua):

    - a batch list ``M:bat:<token>`` that no pending batch names: its items without a result go to
      the reclaimed list as one batch of their shape (the shape from a leaked batches entry that
      names the token, else the model's only signature; with several and no entry the shape is
      unknown and the list is left for a human), items with a result are dropped, and the leaked
      entry is deleted;
    - a lane whose shape instance is gone (finished): the same;
    - a lane of a live instance: its items that already have a result leave it.

    Items counted queued that are in no place at all cannot be rebuilt: they stay ledger findings.
    Returns (changes, what could not be done); the counters are repaired after this.
    """
    mk = K.ModelKeys(model)
    scripts = Scripts(r)
    changes: list[Change] = []
    failed: list[str] = []

    def run(where: str, call: calls.Call[calls.RepairItemsReply]) -> None:
        try:
            moved, cleared, left = call.run(scripts)
        except (redis.ResponseError, ConductorError) as e:
            failed.append(f"{where}: {e}")
            return
        if moved or cleared:
            changes.append(Change(where, "items", str(moved + cleared + left),
                                  f"{left} ({moved} moved to {mk.reclaimed}, {cleared} with a result cleared)"))

    found = classify(r, mk)
    orphans = find_orphans(r, mk, found.bats)
    for token, named in orphans.items():
        place = _orphan_place(r, mk, found, token, named)
        if place is None:
            failed.append(f"{mk.batch_items(token)}: no batches entry names it and the model has "
                          f"{len(found.shapes)} shapes: which shape its items belong to is unknown")
            continue
        run(mk.batch_items(token), calls.repair_items_batch(mk, *place))
    for where, place in _leaked_entries(r, mk, set(orphans)):
        run(where, calls.repair_items_batch(mk, *place))
    for inst, lanes in sorted(found.lanes.items()):
        if not r.exists(mk.inst(inst)):
            for lane in sorted(lanes, key=int):
                run(mk.lane(inst, lane), calls.repair_items_lane(mk, f"{inst}:{lane}"))
    for where in sorted(verify(r, model, items=True).done_lanes):
        inst, lane = where.rsplit(":", 1)
        if r.exists(mk.inst(inst)):
            run(mk.lane(inst, lane), calls.repair_items_done(mk, where))
    return changes, failed


def _leaked_entries(r: redis.Redis, mk: K.ModelKeys, orphans: set[str]) -> list[tuple[str, list[Any]]]:
    """Batches entries that are not pending and whose list is gone: repair_items_batch.lua
    deletes them (nothing to move)."""
    _b, _n, pending, _bad = read_pending(r, mk, None)
    out: list[tuple[str, list[Any]]] = []
    for eid, f in xrange_pages(r, mk.batches):
        token = as_str(f.get(b"k", b""))
        if as_str(eid) not in pending and token and token not in orphans and rules.TOKEN_RE.match(token):
            out.append((f"{mk.batches} {as_str(eid)}", [token, as_str(f.get(b"sig", b"0" * 16)), as_int(f.get(b"ep")),
                                                       as_int(f.get(b"lane")), 1, as_str(eid)]))
    return out


def _orphan_place(r: redis.Redis, mk: K.ModelKeys, found: FoundKeys, token: str,
                  named: tuple[str, dict[bytes, bytes]] | None) -> list[Any] | None:
    """repair_items_batch.lua's arguments for an orphaned batch list: the shape instance and lane
    from the leaked batches entry that names it, else the model's only shape; None when unknown."""
    if named is not None:
        eid, f = named
        return [token, as_str(f.get(b"sig", b"")), as_int(f.get(b"ep")), as_int(f.get(b"lane")),
                as_int(f.get(b"dv")) + 1, eid]
    if len(found.shapes) == 1:
        sig = next(iter(found.shapes))
        return [token, sig, as_int(r.hget(mk.shape(sig), "epoch")), 0, 1, ""]
    return None


def _repair_model(r: redis.Redis, mk: K.ModelKeys) -> list[Change]:
    """Model and job counters from the truth, in one WATCH/MULTI transaction.

    Every script that moves these counters writes the model's state hash, so a script that
    runs between the reads and the writes aborts the transaction (WatchError) instead of
    being overwritten; the job keys cover a job written without a count change.
    """
    found = classify(r, mk)
    jobs_sorted = sorted(found.jobs)
    with r.pipeline(transaction=True) as pipe:
        watch = [mk.state, mk.intake, mk.batches, mk.reclaimed]
        for job in jobs_sorted:
            watch += [mk.job_intake(job), mk.job_sums(job), mk.job(job), mk.job_items(job), mk.job_results(job)]
        pipe.watch(*watch)
        # Reads on the plain client: WATCH sees writes from every connection until EXEC.
        state = {as_str(k): as_str(v) for k, v in r.hgetall(mk.state).items()}
        state.update({as_str(k): as_str(v) for k, v in r.hgetall(mk.intake).items()})
        truth: dict[str, int] = {"tokens": 0, "items": 0}
        for inst in sorted(found.insts):
            tok, n = r.hmget(mk.inst(inst), ["tokens", "items"])
            truth["tokens"] += as_int(tok)
            truth["items"] += as_int(n)
        truth["inflight_batches"], truth["inflight_items"], _ids, _bad = read_pending(r, mk, None)
        truth["reclaimed_items"] = read_reclaimed(r, mk, None)[0]
        sums = {"submitted": 0, "completed": 0, "failed": 0}
        trimmed = False
        job_rows: list[tuple[str, str, str, int]] = []
        for job in jobs_sorted:
            jt = job_truth(r, mk, job, None)
            cur = [r.hget(mk.job_intake(job), "submitted"), *r.hmget(mk.job(job), ["completed", "failed"])]
            for fld, v in zip(("submitted", "completed", "failed"), cur, strict=True):
                sums[fld] += jt[fld]
                if jt["trimmed"] and fld != "submitted":
                    trimmed = True
                    continue  # the ok/error split of trimmed records is gone: leave the counters
                if as_int(v) != jt[fld]:
                    job_rows.append((job, fld, as_str(v) if v is not None else "", jt[fld]))
        if trimmed:
            del sums["completed"], sums["failed"]
        truth.update(sums)
        changes: list[Change] = []
        pipe.multi()
        for fld, value in truth.items():
            if as_int(state.get(fld)) != value:
                # keys.py lists every M:state field; the rest (waiting, submitted) are the producer's
                key = mk.state if fld in K.STATE_FIELDS else mk.intake
                pipe.hset(key, fld, value)
                changes.append(Change(key, fld, state.get(fld, ""), str(value)))
        for job, fld, old, new in job_rows:
            key = mk.job_intake(job) if fld == "submitted" else mk.job(job)
            pipe.hset(key, fld, new)
            changes.append(Change(key, fld, old, str(new)))
        pipe.execute()
    return changes
