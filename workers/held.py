"""What every part of a worker shares: a batch it holds (in flight, with the results it has so far) and
the structured log line it writes per event (workers/worker.py, worker_start.py, outage.py, host_agent.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from conductor.redis_contract.records import Batch, Result

log = logging.getLogger("conductor.worker")


def event(name: str, **fields: object) -> None:
    """One structured log line per event."""
    log.info(json.dumps({"event": name, **fields}, default=str))


@dataclass
class InFlight:
    batch: Batch
    left: int
    results: list[Result] = field(default_factory=list)
    sent: int = 0  # results already queued for writing (an engine that streams them, as they finish)

    def unsent(self) -> list[Result]:
        out, self.sent = self.results[self.sent:], len(self.results)
        return out
