"""The job list (``conductor jobs``): every job Redis knows, with its counters over its models."""

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

    @property
    def state(self) -> str:
        """running: items wait or run; done: every item has a result, none failed; failed: every
        item has a result, some are errors; empty: nothing was ever accepted."""
        if self.pending > 0:
            return "running"
        if self.submitted == 0:
            return "empty"
        return "failed" if self.failed else "done"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state}


def list_jobs(c: Conductor, limit: int | None = None) -> list[JobRow]:
    """The newest ``limit`` jobs (all when None), oldest first; two pipelined reads in all."""
    stop = -1 if limit is None else limit - 1
    newest: Any = c.r.zrevrange(K.JOBS_KEY, 0, stop, withscores=True)  # [(member, score)]
    rows = [JobRow(job=as_str(j), created_ms=int(ms)) for j, ms in reversed(newest)]
    pipe = c.r.pipeline(transaction=False)
    for row in rows:
        pipe.smembers(K.job_models_key(row.job))
    for row, models in zip(rows, pipe.execute(), strict=True):
        row.models = sorted(as_str(m) for m in models)
    pipe = c.r.pipeline(transaction=False)
    for row in rows:
        for m in row.models:
            pipe.hget(K.ModelKeys(m).job_intake(row.job), "submitted")
            pipe.hmget(K.ModelKeys(m).job(row.job), "completed", "failed")
    counts = iter(pipe.execute())
    for row in rows:
        for _ in row.models:
            sub = int(next(counts) or 0)
            done, failed = (int(v or 0) for v in next(counts))
            row.submitted += sub
            row.completed += done
            row.failed += failed
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

