"""Stream retention: the memory of finished work goes back to Redis without touching live work.

``trim_model`` runs from the workers' maintenance sweep; ``trim_job_results`` is the
operator's retention for results that readers have had time to collect.
"""

from __future__ import annotations

from conductor.client import Conductor
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls

FINISHED_KEEP = 10_000


def trim_model(c: Conductor, model: str, *, finished_keep: int = FINISHED_KEEP) -> dict[str, int | str]:
    """Trim the batches stream below its oldest pending batch and the finished stream to a length."""
    got = calls.trim(K.ModelKeys(model), finished_keep).run(c.scripts)
    return {"batches": got.batches, "finished": got.finished, "oldest_pending": got.oldest_pending}


def trim_job_results(c: Conductor, job: str, before_ms: int) -> int:
    """Drop results of ``job`` written before ``before_ms``; refused while the job has work left."""
    return sum(calls.trim_results(K.ModelKeys(model), job, before_ms).run(c.scripts) for model in c.job_models(job))
