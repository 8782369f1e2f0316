"""A real worker process whose engine dies on one item id, for the poison-item tests.

    python -m tests.poison_worker URL MODEL NAME POISON_ID kill|raise HEARTBEAT_TTL_S

``kill``: the process SIGKILLs itself when a batch holding the item reaches the engine (no
cleanup, no hand-back: a segfaulting runtime). ``raise``: the engine raises, the worker lives
and gives the batch back through fail.lua.
"""

from __future__ import annotations

import os
import signal
import sys

from conductor.client import Conductor
from conductor.redis_contract.records import Batch, BatchItem
from conductor.workers.engines.base import Finished
from conductor.workers.engines.sim import SimEngine
from conductor.workers.worker import Worker, WorkerOptions


class PoisonedSim(SimEngine):
    def __init__(self, model: str, poison: str, mode: str) -> None:
        super().__init__(model, max_batch_size=16, max_batch_tokens=4096)
        self.poison = poison
        self.mode = mode

    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        if any(it.id == self.poison for it in items):
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"engine crashed on item {self.poison}")
        return super().admit(batch, items)


def main(argv: list[str]) -> None:
    url, model, name, poison, mode, ttl = argv
    w = Worker(Conductor.from_url(url), PoisonedSim(model, poison, mode),
               WorkerOptions(name=name, heartbeat_ttl_s=float(ttl)))
    w.install_signals()
    w.run()


if __name__ == "__main__":
    main(sys.argv[1:])
