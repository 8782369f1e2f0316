"""Whose work a job is and how urgent (issue 26): its tenant, priority class and deadline.

A job's class is set once, before its first item (lua/job_class.lua, one call per model), and
places its items: a job without a tenant is its own tenant; ``interactive`` work (the request
path's default) is claimed before any other at the next claim of any worker of the model,
``background`` work only takes what nothing else wants, ``batch`` is the rest. Among the tenants
with work waiting, each gets a share of the fleet in proportion to its weight (``conductor tenant T
--weight W``, kept in each model's ``cdr:{M}:tenants``), and within a tenant the job due first goes
first (earliest deadline first).
"""

from __future__ import annotations

import re
import time
from datetime import datetime

from conductor.errors import BadInput
from conductor.jobs.job_state import parse_window
from conductor.redis_contract.records import PRIORITIES, JobClass

__all__ = ["PRIORITIES", "JobClass", "parse_deadline"]

_ISO_HINT = re.compile(r"^\d{4}-\d{2}-\d{2}")


def parse_deadline(text: str | None, field: str = "deadline", now: float | None = None) -> int:
    """``1h``, ``90m``, ``2d`` from now, or an ISO 8601 time (``2026-12-03T09:00:00Z``): ms since
    the epoch; None or '' is no deadline (0)."""
    if not text:
        return 0
    if _ISO_HINT.match(text):
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise BadInput(field, f"not an ISO 8601 time: {text!r}") from None
        if when.tzinfo is None:
            raise BadInput(field, f"an ISO 8601 time needs its zone (Z or +HH:MM): {text!r}")
        return int(when.timestamp() * 1000)
    return int(((time.time() if now is None else now) + parse_window(text, field)) * 1000)
