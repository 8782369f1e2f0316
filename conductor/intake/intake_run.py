"""Running a job's intake task (conductor/intake/intake_task.py) from its cursor: the first run by the
process that took the command or request, a resumed run by whoever took the lapsed lease.

The steps are file_intake's (check every line, ask Redis what it would refuse, declare, send in
chunks), with the task's writes between them: the model defaults once the file is checked, the
state ``sending`` once it is declared, the cursor after each acknowledged chunk, and the end. A
resumed run checks the file again (the same defaults, so the same items) and sends the chunks past
the cursor; a chunk sent again is answered as duplicates by submit.lua. Before each chunk the job's
end is read (``ending`` cancelled or expired in ``cdr:job:J:meta``, or a terminal status): the task
then ends ``stopped`` with that reason, its cursor saying where.

A Batch API task (source ``api``) also moves its batch: ``failed`` with OpenAI-style ``errors`` when
a line is refused, ``in_progress`` once every chunk is in (cancelled when cancelled meanwhile).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError, NoSuchModel, QueueFull, RedisUnavailable
from conductor.formats.items import Facts
from conductor.formats.openai_input import CHAT_URL
from conductor.intake import intake_task as T
from conductor.intake.file_intake import (
    SEND_CHUNK,
    Ahead,
    KnownModels,
    check_file,
    prepare_job,
    scan_to_send,
    send_chunk,
    shifted,
)
from conductor.intake.input_files import FileScan, LineCheck
from conductor.jobs import job_state
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.config import ModelDefaults
from conductor.redis_contract.connection import as_str

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
MAX_ERRORS = 1000  # bad lines listed in a failed batch's errors
# Errors after which the task waits for its lease to lapse and is resumed (by this process's
# resumer or another's), rather than failing the job: Redis away or full, for now.
TRANSIENT = (RedisUnavailable, QueueFull, redis.ConnectionError, redis.TimeoutError, redis.OutOfMemoryError)


class Defaults:
    """``default_max_tokens`` per model: the recorded values of a resumed task, else the model's
    setting now (remembered, to be recorded once the file is checked)."""

    def __init__(self, client: Callable[[], Any], recorded: dict[str, int] | None) -> None:
        self.live = ModelDefaults(client)
        self.seen: dict[str, int] = dict(recorded or {})

    def __call__(self, model: str) -> int:
        if model not in self.seen:
            self.seen[model] = self.live.max_tokens(model)
        return self.seen[model]


def openai_request(endpoint: str, models: Callable[[], list[str]] | None = None) -> LineCheck:
    """The Batch API's check of a valid line: an OpenAI request for the batch's endpoint, for a model
    this Redis knows (``models``; OpenAI's model_not_found: a typo would wait in_progress forever)."""
    served = KnownModels(models, field="body.model", advice="", unknown="is not served here",
                         listed="served") if models is not None else None

    def check(n: int, line: Facts) -> None:
        if line.url is None:  # a native line parses too; this API takes OpenAI's requests only
            raise BadInput("custom_id", "missing: each line is an OpenAI batch request", n)
        if line.url != endpoint:
            raise BadInput("url", f"{line.url} differs from the batch's endpoint {endpoint}", n)
        if served is not None:
            served(n, line)
    return check


def batch_errors(found: FileScan) -> list[dict[str, Any]]:
    """The refused lines in line order, as a batch's ``errors`` lists them."""
    if not found.counts and not found.refused:
        return [{"code": "empty_file", "message": "the input file holds no requests", "param": None, "line": None}]
    return [{"code": "model_not_found" if isinstance(e, NoSuchModel) else "invalid_request", "message": str(e),
             "param": e.field, "line": e.line}
            for e in sorted(found.refusals, key=lambda e: e.line or 0)]


def fail_batch(c: Conductor, job: str, errors: list[dict[str, Any]]) -> None:
    job_state.set_status(c.r, job, "failed", errors=_enc.encode({"object": "list", "data": errors}).decode())


def ended_how(c: Conductor, job: str) -> str:
    """'' while the job may take items; else why not: cancelled, expired (job_state.end records
    ``ending``), or the terminal status it has."""
    ending, status = (as_str(x, absent="") for x in c.r.hmget(K.job_meta_key(job), "ending", "status"))
    if ending in ("cancelled", "expired"):
        return ending
    return status if status in job_state.TERMINAL else ""


def _scan(c: Conductor, task: T.Task, defaults: Defaults) -> FileScan:
    if task.source == "api":
        return scan_to_send(task.path, default_max_tokens=defaults,
                            check=openai_request(task.endpoint or CHAT_URL, c.models),
                            id_field="custom_id", shown=MAX_ERRORS, parquet=False)
    return check_file(task.path, skip_invalid=task.skip_invalid, rejects=None, default_max_tokens=defaults)


@dataclass
class Outcome:
    """How a run of the task ended (done, stopped, failed; 'lost' when another process holds it now,
    'paused' when left for a resumer after a transient error) and what this run sent."""

    state: str = ""
    accepted: int = 0
    duplicates: int = 0
    progress: Callable[[int], None] | None = None  # items of the file sent so far, after each call


def run(c: Conductor, job: str, owner: str, found: FileScan | None = None, defaults: Defaults | None = None,
        progress: Callable[[int], None] | None = None) -> Outcome:
    """Run the job's intake task, whose lease ``owner`` holds, from its cursor; ``found`` (with the
    ``defaults`` it was checked with): the first run's check, done by the caller. A failure of a
    CLI task is raised after it is recorded (an API task's fails its batch)."""
    out = Outcome(progress=progress)
    task = T.read(c.r, job)
    if task is None or task.state not in T.OPEN:
        out.state = task.state if task else "missing"
        return out
    keeper = T.Keeper(c, job, owner)
    try:
        with keeper:
            out.state = _run(c, task, keeper, found, defaults, out)
    except T.Lost:
        log.info("intake of %s: lease taken by another process; stopping here", job)
        out.state = "lost"
    except TRANSIENT as e:
        log.warning("intake of %s paused (%s); it resumes once its lease lapses", job, e)
        out.state = "paused"
    except (ConductorError, redis.ResponseError) as e:  # the input or Redis refused it: for good
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        _end(c, keeper, task, "failed", error=first)
        if task.source != "api":
            raise
        fail_batch(c, job, [{"code": "submit_failed", "message": first, "param": None, "line": None}])
        out.state = "failed"
    return out


def fail_unreadable(c: Conductor, job: str, owner: str, path: str, waited_s: float) -> bool:
    """End the intake task of ``job``, whose lease ``owner`` holds and whose file no process could read
    for ``waited_s`` (conductor/intake/intake_resume.py), ``failed`` with the path; the job fails
    with an error naming it (``input_unreadable``). Lines its intake had sent stay its items and
    are answered as any; the others cannot be named (the file is gone), so the error says how many
    were not sent. False when the task was not ours any more (nothing written)."""
    task = T.read(c.r, job)
    if task is None:
        return False
    how = ended_how(c, job)
    if how:  # cancelled or expired meanwhile: the job's end answers its lines; the task stops there
        if calls.intake_cursor(K.intake_task_key(job), owner, T.LEASE_MS, task.line, task.sent, "stopped",
                               reason=how).run(c.scripts):
            c.r.zrem(K.INTAKE_TASKS_KEY, job)
        return False
    msg = f"input file unreadable: {path} (no process could read it for {waited_s:.0f} s)"
    if not calls.intake_cursor(K.intake_task_key(job), owner, T.LEASE_MS, task.line, task.sent, "failed",
                               error=msg).run(c.scripts):
        return False
    c.r.zrem(K.INTAKE_TASKS_KEY, job)
    declared = as_str(c.r.hget(K.job_meta_key(job), "input_lines"), absent="")
    detail = (f"; {task.sent} item(s) were submitted before it" if task.sent else "; none of its lines was submitted")
    if declared:
        detail += f", of {declared} input line(s)"
    field = "input_file_id" if task.source == "api" else "input_path"
    fail_batch(c, job, [{"code": "input_unreadable", "message": msg + detail, "param": field, "line": None}])
    log.warning("intake of job %s failed: %s", job, msg)
    return True


def _end(c: Conductor, keeper: T.Keeper, task: T.Task, state: str, **fields: str) -> None:
    try:
        keeper.cursor(task.line, task.sent, state, **fields)
    except T.Lost:
        return
    c.r.zrem(K.INTAKE_TASKS_KEY, task.job)


def _run(c: Conductor, task: T.Task, keeper: T.Keeper, found: FileScan | None, defaults: Defaults | None,
         out: Outcome) -> str:
    job = task.job
    if task.size is not None and (task.size, task.mtime_ns) != T.file_identity(task.path):
        raise ConductorError(f"{task.path} changed since its intake began; not resumed")
    if found is None or defaults is None:
        defaults = Defaults(lambda: c.r, task.defaults)
        found = _scan(c, task, defaults)
    if task.source == "api" and (errors := batch_errors(found)):
        fail_batch(c, job, errors)
        _end(c, keeper, task, "failed", error=f"{len(found.refused) or 'no'} valid line(s) refused")
        return "failed"
    T.pause_point(c.r, job, "checked")
    if task.state == "checking":
        how = ended_how(c, job)
        if how:  # cancelled or expired before anything was declared: nothing is written
            _end(c, keeper, task, "stopped", reason=how)
            return "stopped"
        prepare_job(c, found, job, task.job_class)  # refusals before the first write
        size, mtime_ns = T.file_identity(task.path)
        keeper.cursor(0, 0, "sending", defaults=_enc.encode(defaults.seen).decode(), size=str(size),
                      mtime_ns=str(mtime_ns))
        task.state = "sending"
    T.pause_point(c.r, job, "first_chunk")
    how = _send(c, task, keeper, found, out)
    if how:
        return _stopped(c, keeper, task, found, how)
    T.pause_point(c.r, job, "last_chunk")
    for model in sorted(found.counts):
        c.seal(model)
    T.pause_point(c.r, job, "state_change")
    if task.source == "api":
        if ended_how(c, job) == "cancelled":
            job_state.end(c, job, "cancelled")
        elif job_state.describe(c, job, advance=False)["status"] == "validating":
            # (a resumed intake may find every item already run: the batch is completed, not in progress)
            job_state.set_status(c.r, job, "in_progress")
    _end(c, keeper, task, "done")
    return "done"


def _send(c: Conductor, task: T.Task, keeper: T.Keeper, found: FileScan, out: Outcome) -> str:
    """The chunks past the cursor, each followed by its cursor write; returns '' when every chunk is
    in, else how the job ended meanwhile (the chunk not sent)."""
    done, sent_now = task.sent, 0
    # the lines up to the cursor were acknowledged before: not read again
    ahead = Ahead(found, T.send_chunk_size(SEND_CHUNK), after=task.line)
    for chunk in ahead:
        last = chunk[-1][0]
        if sent_now == 1:
            T.pause_point(c.r, task.job, "mid_file")
        how = ended_how(c, task.job)
        if how:
            return how
        if keeper.lost.is_set():
            raise T.Lost(task.job)
        rep = send_chunk(c, chunk, task.job, progress=None if out.progress is None else
                         shifted(out.progress, done), idle=ahead.idle)
        out.accepted += rep.accepted
        out.duplicates += rep.duplicates
        done += len(chunk)
        if sent_now == 0:
            T.pause_point(c.r, task.job, "unrecorded_chunk")
        task.line, task.sent = last, done
        keeper.cursor(last, done)  # one write per acknowledged chunk, which renews the lease too
        sent_now += 1
    return ""


def _stopped(c: Conductor, keeper: T.Keeper, task: T.Task, found: FileScan, how: str) -> str:
    """The job ended (cancelled, expired) while its file was being sent: the task ends there, its
    cursor the last line sent; the models are sealed all the same (what was sent is the job)."""
    for model in sorted(found.counts):
        c.seal(model)
    _end(c, keeper, task, "stopped", reason=how)
    if task.source == "api" and how == "cancelled":
        job_state.end(c, task.job, "cancelled")
    return "stopped"
