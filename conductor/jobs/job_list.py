"""The job list (``conductor jobs``): every job Redis knows, with its counters over its models and
its status, the same one ``conductor status``, the Batch API and the status page show
(``job_state.status_of``)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from conductor.client import Conductor
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str


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
    meta_status: str | None = field(default=None, repr=False)
    ending: str | None = field(default=None, repr=False)
    ends: list[str] = field(default_factory=list, repr=False)
    finalize: bool = field(default=False, repr=False)

    @property
    def state(self) -> str:
        """OpenAI's status names, as ``job_state.status_of`` derives them."""
        from conductor.jobs.job_state import status_of
        return status_of(self.meta_status, self.ending, self.submitted, self.pending, self.lost, self.ends,
                         self.finalize)

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        for k in ("meta_status", "ending", "ends", "lost", "finalize"):
            del row[k]
        return {**row, "state": self.state}


def list_jobs(c: Conductor, limit: int | None = None) -> list[JobRow]:
    """The newest ``limit`` jobs (all when None), oldest first; two pipelined reads in all."""
    stop = -1 if limit is None else limit - 1
    newest: Any = c.r.zrevrange(K.JOBS_KEY, 0, stop, withscores=True)  # [(member, score)]
    rows = [JobRow(job=as_str(j), created_ms=int(ms)) for j, ms in reversed(newest)]
    pipe = c.r.pipeline(transaction=False)
    for row in rows:
        pipe.smembers(K.job_models_key(row.job))
        pipe.hmget(K.job_meta_key(row.job), "status", "ending", "finalize")
    got = iter(pipe.execute())
    for row in rows:
        row.models = sorted(as_str(m) for m in next(got))
        row.meta_status, row.ending, fin = (as_str(v) if v is not None else None for v in next(got))
        row.finalize = fin == "1"
    pipe = c.r.pipeline(transaction=False)
    for row in rows:
        for m in row.models:
            pipe.hmget(K.ModelKeys(m).job_intake(row.job), "submitted", "declared")
            pipe.hmget(K.ModelKeys(m).job(row.job), "completed", "failed", "end")
    counts = iter(pipe.execute())
    for row in rows:
        for _ in row.models:
            sub, declared = (int(v or 0) for v in next(counts))
            done, failed, end = next(counts)
            row.submitted += sub
            row.lost += max(0, declared - sub)
            row.completed += int(done or 0)
            row.failed += int(failed or 0)
            if end is not None:
                row.ends.append(as_str(end))
        row.pending = row.submitted - row.completed - row.failed
    return rows


def render(rows: list[JobRow]) -> str:
    if not rows:
        return "no jobs"
    head = f"{'job':<24} {'created':<19} {'models':<20} {'submitted':>9} {'completed':>9} {'failed':>7} " \
           f"{'pending':>7}  state"
    out = [head]
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created_ms / 1000))
        out.append(f"{r.job:<24} {created:<19} {','.join(r.models) or '-':<20} {r.submitted:>9} {r.completed:>9} "
                   f"{r.failed:>7} {r.pending:>7}  {r.state}")
    return "\n".join(out)

