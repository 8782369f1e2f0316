"""The job list (``conductor jobs``): every job Redis knows, with its counters over its models, its
class (tenant, priority, deadline; one past its deadline said so) and its status, the same one
``conductor status``, the Batch API and the status page show (``job_state.status_of``)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from conductor.client import Conductor
from conductor.jobs.job_state import class_fields
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.shards import fold


@dataclass
class JobRow:
    job: str
    created_ms: int
    models: list[str] = field(default_factory=list)
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    pending: int = 0
    lost: int = 0
    tenant: str | None = None  # None: the job is its own tenant
    priority: str = "batch"
    deadline_ms: int = 0  # 0: none
    meta_status: str | None = field(default=None, repr=False)
    ending: str | None = field(default=None, repr=False)
    ends: list[str] = field(default_factory=list, repr=False)
    finalize: bool = field(default=False, repr=False)
    cancelled: int = field(default=0, repr=False)  # of the failed items, answered by a cancel or an expiry
    expired: int = field(default=0, repr=False)
    meta: dict[str, str] = field(default_factory=dict, repr=False)  # input_lines, refused_lines, input_path, ...

    @property
    def state(self) -> str:
        """OpenAI's status names, as ``job_state.status_of`` derives them."""
        from conductor.jobs.job_state import status_of
        return status_of(self.meta_status, self.ending, self.submitted, self.pending, self.lost, self.ends,
                         self.finalize)

    @property
    def lines(self) -> dict[str, int] | None:
        """The input lines and how each was answered, where the job's input is known
        (``job_state.line_counts``, as ``conductor status`` and ``conductor verify-job`` count them)."""
        from conductor.jobs.job_state import line_counts
        return line_counts(self.meta, self.state, {"completed": self.completed, "failed": self.failed,
                                                   "cancelled": self.cancelled, "expired": self.expired})

    @property
    def past_deadline(self) -> bool:
        from conductor.jobs.job_state import past_deadline
        return past_deadline(self.deadline_ms, self.state)

    def as_dict(self) -> dict[str, Any]:
        """submitted, completed, failed, cancelled, expired, pending: items in Redis, in the words of
        ``conductor status`` (failed: not a cancel's or an expiry's answer); lines: the input lines
        (or None); the job's class, and whether it is past its deadline."""
        from conductor.jobs.job_state import item_answers
        row = asdict(self)
        for k in ("meta_status", "ending", "ends", "lost", "finalize", "meta"):
            del row[k]
        row.update(item_answers(row))
        deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.deadline_ms / 1000)) if self.deadline_ms \
            else None
        return {**row, "deadline": deadline, "past_deadline": self.past_deadline, "lines": self.lines,
                "state": self.state}


_META = ("status", "ending", "finalize", "input_lines", "refused_lines", "input_path", "input_file_id")


def list_jobs(c: Conductor, limit: int | None = None) -> list[JobRow]:
    """The newest ``limit`` jobs (all when None), oldest first; two pipelined reads in all."""
    stop = -1 if limit is None else limit - 1
    newest: Any = c.r.zrevrange(K.JOBS_KEY, 0, stop, withscores=True)  # [(member, score)]
    rows = [JobRow(job=as_str(j), created_ms=int(ms)) for j, ms in reversed(newest)]
    pipe = c.r.pipeline(transaction=False)
    for row in rows:
        pipe.smembers(K.job_models_key(row.job))
        pipe.hmget(K.job_meta_key(row.job), *_META)
    got = iter(pipe.execute())
    for row in rows:
        row.models = sorted(as_str(m) for m in next(got))
        row.meta = {k: as_str(v) for k, v in zip(_META, next(got), strict=True) if v is not None}
        row.meta_status, row.ending = row.meta.get("status"), row.meta.get("ending")
        row.finalize = row.meta.get("finalize") == "1"
    pipe = c.r.pipeline(transaction=False)
    for row in rows:
        for m in row.models:
            pipe.hmget(K.ModelKeys(m).job_intake(row.job), "submitted", "declared", "tenant", "prio", "deadline_ms")
            pipe.hmget(K.ModelKeys(m).job(row.job), "completed", "failed", "end", "cancelled", "expired")
    counts = iter(pipe.execute())
    for row in rows:
        declared_of: dict[str, list[int]] = {}  # a sharded model's declaration is on it, its items on its shards
        for k, m in enumerate(row.models):
            raw_sub, raw_declared, tenant, prio, deadline = (as_str(v, absent="") for v in next(counts))
            if k == 0:  # the class is the same on each model (lua/job_class.lua)
                cls = class_fields(row.job, tenant, prio, deadline)
                row.tenant, row.priority, row.deadline_ms = cls["tenant"], cls["priority"], cls["deadline_ms"]
            sub, declared = int(raw_sub or 0), int(raw_declared or 0)
            done, failed, end, cancelled, expired = next(counts)
            row.cancelled += int(cancelled or 0)
            row.expired += int(expired or 0)
            row.submitted += sub
            pair = declared_of.setdefault(fold(m), [0, 0])
            pair[0] += declared
            pair[1] += sub
            row.completed += int(done or 0)
            row.failed += int(failed or 0)
            if end is not None:
                row.ends.append(as_str(end))
        row.lost = sum(max(0, dec - sub) for dec, sub in declared_of.values())
        row.pending = row.submitted - row.completed - row.failed
        row.models = sorted({fold(m) for m in row.models})
    return rows


def render(rows: list[JobRow]) -> str:
    """One row a job: its input lines and how they were answered where its input is known (the
    figures of ``conductor status`` and ``verify-job``), else ``-`` and its items'; then the items
    submitted to Redis."""
    if not rows:
        return "no jobs"
    head = f"{'job':<24} {'created':<19} {'models':<20} {'lines':>7} {'completed':>9} {'failed':>7} " \
           f"{'cancelled':>9} {'expired':>7} {'refused':>7} {'pending':>7} {'items':>7}  {'tenant':<12} " \
           f"{'priority':<11} {'deadline':<16}  state"
    out = [head]
    for r in rows:
        due = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.deadline_ms / 1000)) if r.deadline_ms else "-"
        late = ", past its deadline" if r.past_deadline else ""
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created_ms / 1000))
        ln = r.lines or {"completed": r.completed, "failed": r.failed - r.cancelled - r.expired,
                         "cancelled": r.cancelled, "expired": r.expired, "refused": 0, "pending": r.pending}
        shown = str(r.lines["input"]) if r.lines else "-"
        out.append(f"{r.job:<24} {created:<19} {','.join(r.models) or '-':<20} {shown:>7} {ln['completed']:>9} "
                   f"{ln['failed']:>7} {ln['cancelled']:>9} {ln['expired']:>7} {ln['refused']:>7} "
                   f"{ln['pending']:>7} {r.submitted:>7}  {r.tenant or '-':<12} {r.priority:<11} {due:<16}  "
                   f"{r.state}{late}")
    return "\n".join(out)

