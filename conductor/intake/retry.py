"""Retry: a job's unanswered or failed lines as a new job, from the job's kept input
(``conductor retry``, ``POST /v1/batches/{id}/retry``).

The lines are taken from the input the job was made from (a batch's uploaded file, the file a CLI
submit recorded, or one named with ``--input``), chosen against the job's answers by the job ledger
(conductor/jobs/job_ledger.py): nothing is rebuilt by hand, and a line is retried as it was written.
Only a job that has ended is retried (a line still pending might yet be answered: it would then be
answered twice over the two jobs). A line failed for a permanent reason (its input is too long for
the model, the intake refused it) would fail again: it is reported and left out unless asked for.
The new job keeps the old one's class (tenant, priority) and names it in ``metadata.retry_of``.
A retried line's dead letter leaves the old job's dead-letter stream (``drop_dead_letters``), so that
no ``dead-letter retry`` answers it a second time in the old job.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgspec
import redis

from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError
from conductor.formats.file_lines import is_parquet, iter_lines
from conductor.jobs import job_ledger, job_state
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import JobClass

KINDS = ("cancelled", "expired", "failed")
# Error codes of lines that would fail the same way again: the engines' input_too_long
# (workers/engines/), a line the intake refused, a batch line refused at validation.
PERMANENT = frozenset({"input_too_long", "validation", "invalid_request"})


def parse_only(text: str | None, field: str = "--only") -> frozenset[str]:
    if not text:
        return frozenset(KINDS)
    kinds = frozenset(k.strip() for k in text.split(",") if k.strip())
    bad = sorted(kinds - set(KINDS))
    if bad or not kinds:
        raise BadInput(field, f"a comma-separated list of {', '.join(KINDS)}, got {text!r}")
    return kinds


@dataclass
class Plan:
    job: str
    status: str
    ids: set[str] = field(default_factory=set)  # the lines to retry, by id
    chosen: Counter[str] = field(default_factory=Counter)  # kind -> lines retried
    permanent: Counter[str] = field(default_factory=Counter)  # code -> lines left out as permanent
    left: Counter[str] = field(default_factory=Counter)  # kind -> failed lines left out by --only

    def render(self) -> str:
        parts = [f"{len(self.ids)} line(s) of job {self.job} ({self.status}) to retry"]
        if self.chosen:
            parts.append(", ".join(f"{n} {k}" for k, n in sorted(self.chosen.items())))
        if self.permanent:
            parts.append("left out as permanent (--include-permanent retries them): " +
                         ", ".join(f"{n} {k}" for k, n in sorted(self.permanent.items())))
        if self.left:
            parts.append("left out by --only: " + ", ".join(f"{n} {k}" for k, n in sorted(self.left.items())))
        return "; ".join(parts)


def plan(c: Conductor, job: str, input_path: str | None, only: Iterable[str] = KINDS,
         include_permanent: bool = False) -> Plan:
    """Which lines of ``job`` to retry: refused while the job runs, or without a kept input."""
    if not c.job_models(job) and not c.r.exists(K.job_meta_key(job)):
        raise ConductorError(f"job {job!r} is unknown to this Redis (conductor jobs lists the jobs)")
    status = job_state.describe(c, job)["status"]
    if status not in job_state.TERMINAL:
        raise ConductorError(f"job {job!r} is {status}: retry it once it has ended (conductor cancel ends it now)")
    if status == "failed" and not c.job_models(job):
        raise ConductorError(f"job {job!r} failed at validation (its errors name each line): nothing of it ran, "
                             "so there is nothing to retry; fix the file and submit it again")
    if not input_path:
        raise ConductorError(f"job {job!r} has no kept input (it was not submitted from a file this host keeps): "
                             "name the file it was submitted from with --input FILE")
    wanted = frozenset(only)
    got = job_ledger.answers(c.results(job))
    out = Plan(job, status)
    seen: set[str] = set()
    # each line parsed as the intake parses it: a line a --skip-invalid submit refused has an id
    # and no answer, and would be taken for an unanswered one (job_ledger.build reads it so too)
    for iid in job_ledger.input_ids(input_path, checked=True):
        if iid is None or iid in seen:
            out.permanent["validation"] += 1  # refused by the intake: it would be refused again
            continue
        seen.add(iid)
        codes = got.get(iid)
        code = codes[0] if codes else (status if status in job_ledger.ENDED_EARLY else "missing")
        if code == "":
            continue  # completed
        kind = code if code in job_ledger.ENDED_EARLY else "failed"
        if kind not in wanted:
            out.left[kind] += 1
        elif code in PERMANENT and not include_permanent:
            out.permanent[code] += 1
        else:
            out.ids.add(iid)
            out.chosen[kind] += 1
    return out


def write_lines(input_path: str, ids: set[str], out: BinaryIO) -> int:
    """The input lines of ``ids`` as they were written (a Parquet row as its JSON), each once."""
    n = 0
    done: set[str] = set()
    if is_parquet(input_path):
        for _n, it, raw in iter_lines(input_path):
            if not isinstance(it, Exception) and it.id in ids and it.id not in done:
                done.add(it.id)
                out.write(raw.rstrip(b"\n") + b"\n")
                n += 1
        return n
    ids_of = job_ledger.input_ids(input_path)
    with open(input_path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            iid = next(ids_of)
            if iid is not None and iid in ids and iid not in done:
                done.add(iid)
                out.write(raw.rstrip(b"\r\n") + b"\n")
                n += 1
    return n


def job_class_of(c: Conductor, job: str) -> JobClass:
    """The old job's class on its first model: its tenant and priority, and its deadline while it
    is still ahead (a retry of an expired job is not born overdue)."""
    models = c.job_models(job)
    if not models:
        return JobClass()
    tenant, prio, deadline = c.r.hmget(K.ModelKeys(models[0]).job_intake(job), "tenant", "prio", "deadline_ms")
    name = as_str(tenant, absent="")
    due = int(deadline or 0)
    return JobClass("" if name == job else name, as_str(prio, absent="batch") or "batch",
                    due if due > time.time() * 1000 else 0)


def retry_metadata(c: Conductor, job: str) -> dict[str, str]:
    """The old job's metadata with ``retry_of`` naming it (checked as OpenAI's limits say)."""
    raw = c.r.hget(K.job_meta_key(job), "metadata")
    meta: dict[str, Any] = dict(msgspec.json.decode(raw)) if raw else {}
    meta["retry_of"] = job
    return job_state.check_metadata(meta)


def submit(c: Conductor, old: str, new: str, source: str, chosen: Plan, path: str) -> int:
    """The chosen lines of ``source`` written to ``path`` (the new job's kept input) and submitted as
    job ``new`` through the file intake, in the old job's class, naming it in ``metadata.retry_of``.
    Returns the items accepted."""
    from conductor.intake.file_intake import check_file, prepare_job, send_file
    from conductor.redis_contract.config import ModelDefaults
    with open(path, "wb") as out:
        write_lines(source, chosen.ids, out)
    found = check_file(path, skip_invalid=False, rejects=None, default_max_tokens=ModelDefaults(lambda: c.r).max_tokens)
    drop_dead_letters(c, old, chosen.ids)  # once the new input checks: a refused retry leaves them
    prepare_job(c, found, new, job_class_of(c, old))
    job_state.start(c.r, new, metadata=retry_metadata(c, old), input_path=path)
    return send_file(c, found, new).accepted


def drop_dead_letters(c: Conductor, job: str, ids: set[str]) -> int:
    """The dead letters of ``job``'s retried lines leave its dead-letter stream before the new job
    is submitted: a later ``dead-letter retry`` would run them again in the old job, and each line
    would then have an answer in both. Their failed answers stay in the old job (a retry cut short
    here finds them failed again and retries them). Returns the entries removed."""
    from conductor.jobs.deadletter import DeadLetter
    try:
        return DeadLetter(c).purge(job=job, ids=ids)
    except redis.exceptions.NoPermissionError:
        raise ConductorError(
            f"retried lines of job {job} have dead letters, which this Redis user may not remove (a producer's "
            f"may not): retry as a worker or admin user, or purge them first (conductor dead-letter purge --job "
            f"{job}); nothing retried") from None
