"""A job's lifecycle: status, timestamps, request counts, metadata, completion window; cancel and expiry.

The lifecycle lives in one global hash per job (``cdr:job:J:meta``, keys.py), next to the job's
models; the request counts are the job's counters over its models (``Conductor.status``), never a
copy. Statuses are OpenAI's: ``validating`` (a serve batch whose file is being read), ``in_progress``,
``finalizing``, ``completed``, ``failed`` (the input was refused), ``expired``, ``cancelling``,
``cancelled``. One truth about a job's end: whoever gives the last item of a job's part on a model
its result (complete.lua in a worker, a cancel_lane.lua, cancel_segment.lua or
cancel_registry.lua step in a canceller) stamps that part's end time and
how it ended (``ended_ms``, ``end`` in the model's job counters ``cdr:{M}:job:J``); a job has ended
when every part has (``status_of``: completed, cancelled or expired). No reader writes a state:
``conductor jobs``, ``conductor status``, the Batch API and the status page all derive the same
status from the same fields, the moment the last result is written.

Cancel (and expiry, the same with the code ``expired``): the job's waiting items get an error
result in bounded steps (lua/cancel_lane.lua: one lane per call, so that the answer keeps the item's
payload and input tokens from its record; then lua/cancel_segment.lua, one store segment per call, and
lua/cancel_registry.lua, one HSCAN page of the job's items per call), in-flight batches finish and keep
their results, then the answered items leave the lanes (lua/repair_items_done.lua per lane,
lua/repair.lua per shape instance). The job ends ``cancelled`` (``expired``) once nothing is pending,
with completed + failed = total. Cancel and expiry act on a job in any state that has not ended,
``validating`` included (a batch whose intake died): lines its intake never submitted are answered
by the end itself, derived from the kept input (conductor/jobs/job_ledger.py).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import msgspec
import redis

from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.packed_ids import job_segments
from conductor.redis_contract.scripts import ScriptClient
from conductor.redis_contract.shards import fold

log = logging.getLogger(__name__)

STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
_STAMPS = ("created_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
           "cancelling_at", "cancelled_at", "expires_at")
STEP = 1000  # registry entries per cancel_registry.lua call
RESWEEP_S = 5.0  # a cancelling job with items pending (failed batches put back) is swept again this often
LINGER_S = 600.0  # an expired job whose intake had not sent every line is looked at this long after its last sweep
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 and values of 512 characters

_WINDOW = re.compile(r"^(\d{1,6})([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: str, field: str = "completion_window") -> int:
    """A completion window such as ``24h``, ``90m``, ``7d`` in seconds."""
    m = _WINDOW.match(text or "") if isinstance(text, str) else None
    if not m or int(m.group(1)) == 0:
        raise BadInput(field, f"must be a whole number and a unit (s, m, h, d) such as 24h, got {text!r}")
    return int(m.group(1)) * _UNIT[m.group(2)]


def check_metadata(meta: Any, field: str = "metadata") -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or len(meta) > MAX_METADATA:
        raise BadInput(field, f"must be an object of at most {MAX_METADATA} string pairs")
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise BadInput(f"{field}.{k}", "keys must be strings of at most 64 characters, values of at most 512")
    return dict(meta)


def start(r: redis.Redis, job: str, *, status: str = "in_progress", window_s: int | None = None,
          window: str | None = None, metadata: dict[str, str] | None = None, **extra: str) -> None:
    """Record a job's lifecycle (its creation; a re-submit of the same job keeps the first stamps)."""
    now = int(time.time())
    key = K.job_meta_key(job)
    pipe = r.pipeline(transaction=False)  # a producer's ACL has no MULTI
    pipe.hsetnx(key, "created_at", now)
    pipe.hsetnx(key, "status", status)
    if status == "in_progress":
        pipe.hsetnx(key, "in_progress_at", now)
    if window_s:
        pipe.hsetnx(key, "completion_window", window or f"{window_s}s")
        pipe.hsetnx(key, "expires_at", now + window_s)
        pipe.zadd(K.JOB_DEADLINES_KEY, {job: now + window_s}, nx=True)
    if metadata:
        pipe.hsetnx(key, "metadata", msgspec.json.encode(metadata))
    for k, v in extra.items():
        pipe.hset(key, k, v)
    pipe.execute()


def set_status(r: redis.Redis, job: str, status: str, **fields: Any) -> None:
    """Move to ``status`` (stamping ``<status>_at`` once) unless the job has ended already."""
    key = K.job_meta_key(job)
    if as_str(r.hget(key, "status"), absent="") in TERMINAL:
        return
    now = int(time.time())
    pipe = r.pipeline(transaction=True)
    pipe.hset(key, "status", status)
    for k, v in fields.items():
        pipe.hset(key, k, v)
    pipe.hsetnx(key, f"{status}_at", now)
    if status in TERMINAL:
        pipe.zrem(K.JOB_DEADLINES_KEY, job)
    pipe.execute()


def job_class_of(r: redis.Redis, job: str, models: list[str]) -> dict[str, Any]:
    """The job's class as its first model holds it (lua/job_class.lua writes the same on each):
    ``tenant`` (None: the job is its own tenant), ``priority``, ``deadline_ms`` (0: none)."""
    if not models:
        return {"tenant": None, "priority": "batch", "deadline_ms": 0}
    tenant, prio, deadline = (as_str(v, absent="") for v in
                              r.hmget(K.ModelKeys(models[0]).job_intake(job), "tenant", "prio", "deadline_ms"))
    return class_fields(job, tenant, prio, deadline)


def class_fields(job: str, tenant: str, prio: str, deadline: str) -> dict[str, Any]:
    """The class as a reader shows it, from the stored fields (tenant '' or the job's name: its own)."""
    return {"tenant": tenant if tenant and tenant != job else None, "priority": prio or "batch",
            "deadline_ms": int(deadline or 0)}


def past_deadline(deadline_ms: int, status: str, now: float | None = None) -> bool:
    """A job not yet ended whose deadline has passed (``conductor jobs`` and ``status`` report it)."""
    return bool(deadline_ms) and status not in TERMINAL and (time.time() if now is None else now) * 1000 > deadline_ms


def ago(seconds: float) -> str:
    """``3m``, ``2h``, ``4d``: a span as the class lines show it."""
    s = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def class_text(cls: dict[str, Any], status: str, now: float | None = None) -> str:
    """``tenant T, priority P, deadline 2026-12-03 09:00:00 (past it by 5m)``."""
    now = time.time() if now is None else now
    parts = [f"tenant {cls['tenant'] or '-'}", f"priority {cls['priority']}"]
    if cls["deadline_ms"]:
        due = cls["deadline_ms"] / 1000
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(due))
        note = f" (past it by {ago(now - due)})" if past_deadline(cls["deadline_ms"], status, now) else \
            (f" (in {ago(due - now)})" if due > now and status not in TERMINAL else "")
        parts.append(f"deadline {when}{note}")
    return ", ".join(parts)


def status_of(meta_status: str | None, ending: str | None, submitted: int, pending: int, lost: int,
              ends: list[str], finalize: bool = False) -> str:
    """A job's one status: ``failed`` (its input was refused) as recorded; ended when every item has
    its result (how: the parts' end stamps ``ends``, or the cancel or expiry under way); else what
    the lifecycle recorded, ``cancelling`` while a cancel is answering its items. A Batch API batch
    (``finalize``: its lifecycle's mark) whose every item is answered is ``finalizing`` until its
    output and error files are written (conductor/api/finalize.py records ``completed``)."""
    if meta_status in TERMINAL:
        return meta_status  # failed at validation (or a stamp of an older version)
    if ending in ("cancelled", "expired") and pending <= 0:
        # Ended early with nothing left in Redis: lines never submitted (an intake stopped by the
        # end, or a serve that died while validating: ``lost``, or nothing sent at all) are answered
        # by the end itself, derived from the input (conductor/jobs/job_ledger.py).
        return "cancelled" if "cancelled" in ends or ending == "cancelled" else ending
    if submitted > 0 and pending <= 0 and lost <= 0:
        for how in ("cancelled", "expired"):
            if how in ends or ending == how:
                return how
        return "finalizing" if finalize else "completed"
    if ending == "cancelled":
        return "cancelling"
    return meta_status or "in_progress"


def line_counts(meta: dict[str, str], status: str, st: dict[str, Any]) -> dict[str, int] | None:
    """How the job's input lines were answered, where its input is known (a CLI submit's or a batch's
    file: the intake recorded ``input_lines`` and ``refused_lines``); None otherwise (a library
    submit, a job made from several files: its counts are items). The same figures as the job's
    ledger (conductor/jobs/job_ledger.py) from counters alone: ``input`` lines; ``completed``,
    ``failed`` (an error of the engine or the dead letter), ``cancelled``, ``expired`` (by the end,
    lines never submitted included), ``refused`` (at validation) the lines the intake refused, and
    ``pending``, lines with no answer yet (not yet submitted ones included). ``st``: the job's counters
    (``Conductor.status``)."""
    if not meta.get("input_lines") or not (meta.get("input_path") or meta.get("input_file_id")):
        return None
    total, refused = int(meta["input_lines"]), int(meta.get("refused_lines") or 0)
    by_end = st.get("cancelled", 0) + st.get("expired", 0)
    out = {"input": total, "completed": st["completed"], "failed": max(0, st["failed"] - by_end),
           "cancelled": st.get("cancelled", 0), "expired": st.get("expired", 0), "refused": refused, "pending": 0}
    rest = max(0, total - refused - st["completed"] - st["failed"])
    if status in ("cancelled", "expired"):
        out[status] += rest  # never submitted: answered by the end (job_ledger.unsent_lines)
    elif status == "failed":
        out["failed"] += rest  # the job failed (its input unreadable): no line left will be answered
    else:
        out["pending"] = rest
    return out


def _ends(c: Conductor, job: str, models: list[str]) -> tuple[list[str], int | None]:
    """Each part's end stamp (complete.lua, lib_cancel.lua) and the job's end time in ms: the latest
    stamp, or, for a part that ended without one (its last item dead-lettered), the time of its
    last result (its stream id); None while a part is running."""
    pipe = c.r.pipeline(transaction=False)
    for m in models:
        pipe.hmget(K.ModelKeys(m).job(job), "ended_ms", "end")
    ends, times, unstamped = [], [], []
    for m, (ms, how) in zip(models, pipe.execute() if models else [], strict=True):
        if ms is None:
            unstamped.append(m)
        else:
            times.append(int(ms))
            ends.append(as_str(how, absent="completed"))
    for m in unstamped:
        last = c.r.xrevrange(K.ModelKeys(m).job_results(job), "+", "-", count=1)
        if not last and any(fold(o) == m != o for o in models):
            continue  # a sharded model: its declaration here, its items and their answers on its shards
        if not last:
            return ends, None
        times.append(int(as_str(last[0][0]).split("-")[0]))
    return ends, max(times) if times else None


def item_answers(st: dict[str, Any]) -> dict[str, int]:
    """The job's items by how each was answered, in the words every reader uses (issue 37):
    ``failed`` an error of the engine or the dead letter, never a cancel's or an expiry's answer,
    which are ``cancelled`` and ``expired`` (``Conductor.status`` counts those among its ``failed``)."""
    by_end = st.get("cancelled", 0) + st.get("expired", 0)
    return {"submitted": st["submitted"], "completed": st["completed"], "failed": max(0, st["failed"] - by_end),
            "cancelled": st.get("cancelled", 0), "expired": st.get("expired", 0), "pending": st["pending"]}


def describe(c: Conductor, job: str, *, advance: bool = True, now: float | None = None) -> dict[str, Any]:
    """The job's lifecycle with its request counts; with ``advance`` an expired window is acted on
    (and a cancel's items put back meanwhile answered): the expiry owner's moves, never a state."""
    meta = {as_str(k): as_str(v) for k, v in c.r.hgetall(K.job_meta_key(job)).items()}
    st = c.status(job)
    models = sorted(st["models"])
    ends, ended_ms = _ends(c, job, models)
    status = status_of(meta.get("status"), meta.get("ending"), st["submitted"], st["pending"], st["lost"], ends,
                       meta.get("finalize") == "1")
    if advance and status not in TERMINAL:  # validating too: a batch whose intake died must end
        now = now or time.time()
        ending = meta.get("ending")
        expires = float(meta.get("expires_at") or 0)
        if not ending and expires and now >= expires and meta:
            end(c, job, "expired")
            return describe(c, job, advance=False)
        if ending and now - float(meta.get("swept_at") or 0) >= RESWEEP_S:
            _sweep(c, job, ending)
            return describe(c, job, advance=False)
    if advance and status in TERMINAL and meta.get("expires_at") and (
            st["lost"] <= 0 or (now or time.time()) - float(meta.get("swept_at") or 0) > LINGER_S):
        # nothing left to expire; a job that ended before its intake sent every line (lost) stays a
        # while, so that lines a still running intake adds are answered by the next sweep too
        c.r.zrem(K.JOB_DEADLINES_KEY, job)
    _derived_stamps(meta, status, ended_ms)
    lines = line_counts(meta, status, st)
    rc = {"total": st["submitted"], "completed": st["completed"], "failed": st["failed"]}
    if lines is not None:  # OpenAI's counts of the lines the job took (the ledger's request_counts)
        rc["total"] = lines["input"] - lines["refused"]
        rc["failed"] = rc["total"] - rc["completed"] - lines["pending"]
    out: dict[str, Any] = {"job": job, "status": status, "request_counts": rc, "lines": lines,
                           "pending": st["pending"], "submitted": st["submitted"],
                           "models": sorted({fold(m) for m in st["models"]}),  # a sharded model once
                           "items": item_answers(st), **job_class_of(c.r, job, models),
                           "completion_window": meta.get("completion_window"),
                           "metadata": msgspec.json.decode(meta["metadata"]) if meta.get("metadata") else None}
    for stamp in _STAMPS:
        out[stamp] = int(meta[stamp]) if meta.get(stamp) else None
    for k in ("input_file_id", "endpoint", "errors", "ending"):
        if meta.get(k):
            out[k] = meta[k]
    if (status in TERMINAL or status == "finalizing") and ended_ms is not None:
        out["ended_ms"] = ended_ms
    return out


def _derived_stamps(meta: dict[str, str], status: str, ended_ms: int | None) -> None:
    """The stamps no writer recorded, from the job's end: finalizing since the last answer (the
    finalizer keeps that one), ended then; or, for a job that ended before anything was submitted,
    at its sweep."""
    if status == "finalizing" and ended_ms is not None:
        meta.setdefault("finalizing_at", str(ended_ms // 1000))
    if status in TERMINAL and status != "failed" and ended_ms is not None:
        # only a completed job went through finalizing; a cancelled or expired one ended without it
        for stamp in ("finalizing_at", f"{status}_at") if status == "completed" else (f"{status}_at",):
            meta.setdefault(stamp, str(ended_ms // 1000))
    elif status in ("cancelled", "expired") and meta.get("swept_at"):  # ended before anything was submitted
        meta.setdefault(f"{status}_at", str(int(float(meta["swept_at"]))))


def cancel(c: Conductor, job: str) -> dict[str, Any]:
    """``conductor cancel``: see the module's docstring. Cancelling a cancelled or cancelling job is a
    no-op; a job that ended otherwise is refused."""
    if not c.job_models(job) and not c.r.exists(K.job_meta_key(job)):
        raise ConductorError(f"job {job!r} is unknown to this Redis (conductor jobs lists the jobs)")
    status = describe(c, job)["status"]
    if status in ("cancelled", "cancelling"):
        return describe(c, job)
    if status in TERMINAL:
        raise ConductorError(f"job {job!r} is {status}: nothing to cancel")
    return end(c, job, "cancelled")


def end(c: Conductor, job: str, how: str) -> dict[str, Any]:
    """End a job early: ``how`` is 'cancelled' (conductor cancel) or 'expired' (its window passed)."""
    if how == "cancelled":
        set_status(c.r, job, "cancelling", ending="cancelled")
    else:
        c.r.hset(K.job_meta_key(job), "ending", "expired")
    _sweep(c, job, how)
    return describe(c, job)


def expire_due(c: Conductor, now: float | None = None) -> list[str]:
    """End every job whose completion window has passed (``conductor expire``; the periodic sweep
    is ``expire_due_leased``). The steps are idempotent."""
    due = [as_str(j) for j in c.r.zrangebyscore(K.JOB_DEADLINES_KEY, "-inf", now or time.time())]
    for job in due:
        meta_status = as_str(c.r.hget(K.job_meta_key(job), "status"), absent="")
        if meta_status in TERMINAL:
            c.r.zrem(K.JOB_DEADLINES_KEY, job)
            continue
        describe(c, job, now=now)  # acts on the window, then moves to expired once nothing is in flight
    return due


# Expiry has one owner at a time: whoever holds this lease. Both the maintenance lease holders
# (workers/maintenance.py, a worker of any model) and every serve replica (conductor/api/app.py)
# ask for it, because a production deployment may run either without the other: a fleet scaled
# to zero (deploy/keda) still owes a Batch API caller its answer when the window passes, and a job
# submitted with --completion-window on the command line has no serve to end it. The lease keeps
# the sweep to one process at a time (the steps are idempotent, but several sweepers only repeat
# each other's reads); a holder that dies hands over once the lease lapses.
EXPIRY_LEASE_MS = 15_000  # a few of the slowest caller's periods (serve: 5 s)


def first_deadline(c: Conductor) -> float | None:
    """The earliest completion deadline among the jobs (epoch seconds), None when no job has one: one
    read that says both whether one is due and when the next is (an idle lease holder sleeps till
    then, workers/maintenance.py)."""
    got = c.r.zrange(K.JOB_DEADLINES_KEY, 0, 0, withscores=True)
    return float(got[0][1]) if got else None


def expire_due_leased(c: Conductor, owner: str, lease_ms: int = EXPIRY_LEASE_MS) -> list[str] | None:
    """``expire_due`` if ``owner`` holds (or now takes) the expiry lease; None when another does. With
    nothing due, one read and no lease call: every maintenance lease holder and serve replica asks each
    second, and an idle fleet's holder is to send about one command a second (issue 36)."""
    if not c.r.zrangebyscore(K.JOB_DEADLINES_KEY, "-inf", time.time(), start=0, num=1):
        return []
    if not calls.lease(K.EXPIRY_LEASE_KEY, owner, lease_ms).run(c.scripts):
        return None
    return expire_due(c)


def _sweep(c: Conductor, job: str, how: str) -> int:
    """Every waiting item of the job answered (bounded steps), then withdrawn from the lanes. The
    lanes first, one per cancel_lane.lua call: an answer made there keeps the item's input tokens and
    payload (its record is in the lane); then the job's store segments (their id lists), then the
    id registry, for items waiting anywhere else."""
    message = "the batch was cancelled before this request ran" if how == "cancelled" else \
        "the batch's completion window passed before this request ran"
    total = 0
    c.r.hset(K.job_meta_key(job), "swept_at", time.time())
    for model in c.job_models(job):
        mk = K.ModelKeys(model)
        insts = {as_str(i) for i in c.r.zrange(mk.active, 0, -1)} | {as_str(i) for i in c.r.zrange(mk.staged, 0, -1)}
        for inst in sorted(insts):
            for lane in c.r.zrange(mk.inst_lanes(inst), 0, -1):
                total += calls.cancel_lane(mk, job, fold(model), f"{inst}:{as_str(lane)}", how, message).run(
                    c.scripts).answered
        # store segments of the job: their ids wait in no lane and no registry entry (schema 6)
        for name in job_segments(c.r, mk, job):
            total += calls.cancel_segment(mk, job, fold(model), name, how, message).run(c.scripts).answered
        cursor = "0"
        while True:
            step = calls.cancel_registry(mk, job, fold(model), cursor, STEP, how, message).run(c.scripts)
            cursor = step.cursor
            total += step.answered
            if cursor == "0":
                break
        withdraw(c, model)
    return total


def withdraw(c: ScriptClient, model: str) -> int:
    """Answered items out of the lanes of ``model``'s live shape instances (one lane per
    repair_items_done.lua call, then one repair.lua call per instance that changed): items nothing
    will run no longer hold a worker or count as waiting."""
    r = c.r
    mk = K.ModelKeys(model)
    insts = {as_str(i) for i in r.zrange(mk.active, 0, -1)} | {as_str(i) for i in r.zrange(mk.staged, 0, -1)}
    cleared = 0
    for inst in sorted(insts):
        changed = False
        for lane in r.zrange(mk.inst_lanes(inst), 0, -1):
            try:
                n = calls.repair_items_done(mk, f"{inst}:{as_str(lane)}").run(c.scripts).cleared
            except (redis.ResponseError, ConductorError) as e:  # a lane claimed away meanwhile, a finished instance
                log.debug("withdraw %s %s:%s: %s", model, inst, as_str(lane), e)
                continue
            cleared += int(n)
            changed = changed or int(n) > 0
        if changed:
            try:
                calls.repair(mk, inst, []).run(c.scripts)
            except (redis.ResponseError, ConductorError) as e:
                log.warning("withdraw %s %s: fill and ready not recounted: %s", model, inst, e)
    return cleared


LINE_KINDS = ("completed", "failed", "cancelled", "expired", "refused", "pending")
ITEM_KINDS = ("completed", "failed", "cancelled", "expired", "pending")


def render(d: dict[str, Any]) -> str:
    """``conductor status J``'s first line: the input lines when known (as ``conductor verify-job``
    and the Batch API count them), then the items in Redis; else the items alone."""
    rc = d["request_counts"]
    parts = [f"job {d['job']}: {d['status']}"]
    if d.get("lines"):
        ln = d["lines"]
        parts.append(f"lines {ln['input']}: " + ", ".join(f"{ln[k]} {k}" for k in LINE_KINDS))
        parts.append(f"items submitted {d['submitted']}, pending {d['pending']}")
    else:
        it = d.get("items") or {"submitted": rc["total"], "completed": rc["completed"], "failed": rc["failed"],
                                "cancelled": 0, "expired": 0, "pending": d["pending"]}
        parts.append(f"items {it['submitted']}: " + ", ".join(f"{it[k]} {k}" for k in ITEM_KINDS))
    if "priority" in d:
        parts.append(class_text(d, d["status"]))
    stamps = [f"{s[:-3]} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(d[s]))}" for s in _STAMPS
              if d.get(s)]
    if stamps:
        parts.append("; ".join(stamps))
    if d.get("completion_window"):
        parts.append(f"window {d['completion_window']}")
    if d.get("metadata"):
        parts.append("metadata " + msgspec.json.encode(d["metadata"]).decode())
    return " | ".join(parts)

