"""How much a worker claims: claims follow the engine (issue 37).

A worker asks for at most what its engine wants now, so the backlog waits in Redis, where a cancel,
a priority or a tenant's fair share still acts on it. Three limits, the smallest wins:

* the admission latch's room under its high-water mark (workers/latch.py), when one is set;
* the pending ceiling (``--pending-ceiling``): items pulled and not yet written back;
* the engine's own ``room`` (workers/engines/base.py): an engine that runs a bounded set at once (vLLM's
  ``max_num_seqs``; the sim and torch engines the same way, their batch by default) says it wants a
  batch's worth only once what it has not started is under half the last batch it got, so the worker
  holds about one batch beyond what the engine runs; ``openai`` counts what it has not sent. An engine
  with no limit of its own (None) leaves it to the other two.
"""

from __future__ import annotations

from collections.abc import Callable

from conductor.redis_contract.records import Contract

from .engines.base import Engine
from .latch import AdmissionLatch


def free_slots(latch: AdmissionLatch, engine: Engine, pending_ceiling: int | None,
               pending: Callable[[], int]) -> int | None:
    """How many items one pull may ask for (None: only the engine's contract limits it)."""
    limits = [x for x in (latch.room(engine.active()),
                          None if pending_ceiling is None else pending_ceiling - pending(),
                          engine.room()) if x is not None]
    return min(limits) if limits else None


def claim_contract(contract: Contract, free: int | None) -> Contract | None:
    """The contract one claim asks under: the engine's, its batch cut to ``free``; None: no room now."""
    if free is not None and free <= 0:
        return None
    size = contract.max_batch_size if free is None else min(contract.max_batch_size, free)
    return Contract(model=contract.model, max_batch_size=size, max_batch_tokens=contract.max_batch_tokens,
                    max_input_len=contract.max_input_len)


# After a claim that found nothing at all ('idle') while the engine still runs (a job's tail), the next
# claim waits for a ring taken off the doorbell (new work: submit.lua and seal.lua ring), the engine's
# end (then workers/idle.py's wait), or IDLE_RECHECK_S (work that comes without a ring: a dead worker's
# batches put back; an idle worker looks at its beat, 5 s). Such a worker used to claim after every
# engine step and find nothing each time: 1,204 empty claims in a 16-worker job of 8,000 items, 8 % of
# the job's Redis instructions (bench/RESULTS.md, the Redis cost notes' third pass).
# After 'wait' (work waits but is held back: the active shape waits for a full batch or quiet intake,
# the shapes left are other workers' until they lag, a claim's visits ran out) the same, with the
# model's quiet time as the recheck: the moment a claim may dispatch what it held back without a ring
# (quiet intake starts cleanup and drains), as an idle worker's doorbell wait after 'wait' is bounded
# (workers/doorbell.py). Not after 'gate': the release gate opens on submits, which ring, or quiet
# intake, and a gated worker's engine is empty anyway. Each such claim runs the full pass (about 0.8M
# instructions at 16 workers: 39 of them in an 8,000-item job, 2 % of its Redis instructions).
IDLE_RECHECK_S = 1.0
RING_LOOK_S = 0.05  # the doorbell is looked at (one LPOP) at most this often meanwhile


class BusyIdle:
    """Whether a worker whose engine runs may claim now, after an 'idle' or 'wait' answer (clock: the
    worker's)."""

    def __init__(self) -> None:
        self.since: float | None = None  # when a claim answered 'idle' or 'wait' with the engine running
        self.recheck = IDLE_RECHECK_S  # then the next claim goes at the latest this long after it
        self._looked = 0.0
        self.skipped = 0  # turns that did not claim (tests, metrics)
        self.rang = False  # the last claim let through was let through by a ring (pass it on if it finds work)

    def answered(self, answer: str, running: bool, now: float, quiet_s: Callable[[], float] | None = None) -> None:
        """``quiet_s``: the model's quiet time, asked only after a 'wait' (None: IDLE_RECHECK_S then too)."""
        self.since = None
        if running and answer == "idle":
            self.since, self.recheck = now, IDLE_RECHECK_S
        elif running and answer == "wait":
            self.since, self.recheck = now, IDLE_RECHECK_S if quiet_s is None else quiet_s()

    def due(self, running: bool, now: float, take_ring: Callable[[], bool]) -> bool:
        self.rang = False
        if self.since is None or not running or now - self.since >= self.recheck:
            return True
        if now - self._looked >= RING_LOOK_S:
            self._looked = now
            if take_ring():
                self.rang = True
                return True
        self.skipped += 1
        return False
