"""Stream retention: the memory of finished work goes back to Redis without touching live work.

``trim_model`` runs from the workers' maintenance sweep; ``trim_job_results`` is the
operator's retention for results that readers have had time to collect.
"""

from __future__ import annotations

from conductor import keys as K
from conductor.client import Conductor

FINISHED_KEEP = 10_000


def trim_model(c: Conductor, model: str, *, finished_keep: int = FINISHED_KEEP) -> dict[str, int | str]:
    """Trim the batches stream below its oldest pending batch and the finished stream to a length."""
    mk = K.ModelKeys(model)
    batches, finished, oldest = c.scripts.trim(keys=[mk.batches, mk.finished], args=[finished_keep])
    return {"batches": int(batches), "finished": int(finished),
            "oldest_pending": oldest.decode() if isinstance(oldest, bytes) else str(oldest)}


def trim_job_results(c: Conductor, job: str, before_ms: int) -> int:
    """Drop results of ``job`` written before ``before_ms``; refused while the job has work left."""
    script = c.scripts.trim_results
    n = 0
    for model in c.job_models(job):
        mk = K.ModelKeys(model)
        n += int(script(keys=[mk.job_intake(job), mk.job(job), mk.job_results(job)], args=[before_ms]))
    return n
