"""Pre-warm: which shape instances' graphs this worker has prepared, and preparing the next.

The pre-warm signal rides on claim replies (``Batch.warming``, claim.lua's last field); a switch
to another instance, or a batch at a padded length not prepared yet, prepares the served
instance's lanes too. Graphs are built while the current batch runs, not one per batch as they come.
"""

from __future__ import annotations

import json
import logging

from conductor.client import Conductor
from conductor.redis_contract.records import Batch

from .engines.base import Engine

log = logging.getLogger("conductor.worker")


class Prewarm:
    def __init__(self, conductor: Conductor, engine: Engine, model: str, worker: str) -> None:
        self.c = conductor
        self.engine = engine
        self.model = model
        self.worker = worker
        self.lens: dict[str, frozenset[int]] = {}  # instance -> padded lengths prepared
        self.serving = ""

    def after_claim(self, batch: Batch) -> None:
        """Prepare what this claimed batch says comes: its own instance's lanes when they are new to
        this worker (a switch, a shape shared with other workers, a lane opened or grown since), and
        the warming instance the claim named."""
        serving = f"{batch.shape}:{batch.epoch}"
        # A switch to the instance warmed last is no news: its lanes were prepared (and logged) then.
        new = batch.padded_len not in self.lens.get(serving, ())
        self.serving = serving
        if new:
            self.prepare(serving)
        if batch.warming and batch.warming not in self.lens:
            self.prepare(batch.warming)

    def prepare(self, inst: str) -> None:
        shape, epoch, lanes = self.c.prewarm_info(self.model, inst)
        # The instances prepared last (the one served, the warming one): their padded lengths.
        self.lens = {k: v for k, v in self.lens.items() if k in (self.serving, inst)}
        self.lens[inst] = frozenset(lanes)
        self.engine.prewarm(shape, lanes, epoch)
        log.info(json.dumps({"event": "prewarm", "worker": self.worker, "shape": shape, "epoch": epoch,
                             "lanes": len(lanes)}))
