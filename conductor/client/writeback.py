"""How a batch ends: its results written (complete.lua, confirmed on replicas with WAIT), given
back by the worker (fail.lua), or taken from a dead consumer (reclaim.lua)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from conductor.client.core import ConductorCore
from conductor.client.fleet import model_alive
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import Batch, Result


class Writeback(ConductorCore):
    def complete(self, batch: Batch, results: Sequence[Result], *, final: bool = True) -> tuple[int, int]:
        """Write results (idempotent on item id); with ``final`` ack and delete the batch."""
        written, acked = self._confirmed(calls.complete(K.ModelKeys(batch.model), batch.batch_id, results,
                                                        final=final))
        return written, acked

    def fail(self, batch: Batch, consumer: str, reason: str) -> tuple[int, int]:
        """Give back a batch the engine could not run: (items requeued, items dead-lettered)."""
        requeued, dead = calls.fail(K.ModelKeys(batch.model), batch.batch_id, consumer, reason).run(self.scripts)
        return requeued, dead

    def reclaim_consumer(self, model: str, consumer: str, *, force: bool = False,
                         min_idle_ms: int = 0, count: int = 100) -> dict[str, int]:
        """Move ``consumer``'s pending batches to the reclaimed queue if it is dead (or ``force``)."""
        mk = K.ModelKeys(model)
        total = {"batches": 0, "items": 0, "dead": 0, "left": 0, "deleted": 0}
        while True:
            got = calls.reclaim(mk, consumer, force=force, min_idle_ms=min_idle_ms, count=count).run(self.scripts)
            total["batches"] += got.batches
            total["items"] += got.items
            total["dead"] += got.dead
            total["left"] = got.left
            total["deleted"] = got.deleted
            if got.batches < count:
                return total

    def consumers(self, model: str, *, pending_only: bool = False) -> list[dict[str, Any]]:
        mk = K.ModelKeys(model)
        try:
            rows = self.r.xinfo_consumers(mk.batches, K.GROUP)
        except redis.ResponseError:
            return []
        out = [{as_str(k): (as_str(v) if isinstance(v, bytes) else v) for k, v in row.items()} for row in rows]
        if pending_only:
            out = [row for row in out if row.get("pending")]
        # one round trip for the fleet: the lease holder asks every second (workers/maintenance.py)
        pipe = self.r.pipeline(transaction=False)
        for row in out:
            pipe.exists(mk.heartbeat(row["name"]))
        for row, alive in zip(out, pipe.execute() if out else [], strict=True):
            row["alive"] = row["heartbeat"] = bool(alive)
        # on a shard, alive only while the model's own heartbeat lives too (client/fleet.py model_alive)
        beating = [row for row in out if row["alive"]]
        for row, alive in zip(beating, model_alive(self.r, model, [row["name"] for row in beating]), strict=True):
            row["alive"] = alive
        return out

    def reclaim_dead(self, model: str, *, min_idle_ms: int = 0, pending_only: bool = False) -> dict[str, int]:
        """One reclaim sweep over every consumer of ``model`` without a live heartbeat (``in_flight``: the
        batches pending when it looked, what each consumer held). ``pending_only``:
        only consumers that hold batches (a dead one holding none is only forgotten), and nothing read
        past one XPENDING while no batch is in flight: the lease holder of an idle fleet sweeps every
        second, and XINFO CONSUMERS with a heartbeat read per consumer grew with the fleet (issue 36)."""
        total = {"consumers": 0, "batches": 0, "items": 0, "dead": 0, "in_flight": 0}
        if pending_only:
            try:
                total["in_flight"] = int(self.r.xpending(K.ModelKeys(model).batches, K.GROUP)["pending"])
            except redis.ResponseError:  # no stream or group yet: nothing in flight
                return total
            if not total["in_flight"]:
                return total
        rows = self.consumers(model, pending_only=pending_only)
        if not pending_only:
            total["in_flight"] = sum(int(row.get("pending") or 0) for row in rows)
        for row in rows:
            # a live consumer with nothing pending has nothing to lose: no reclaim.lua call for each
            # idle worker of the fleet every second
            if row["alive"] and (not min_idle_ms or not row.get("pending")):
                continue
            if not row["alive"] and row["heartbeat"]:
                # dead on the model's own keys, its shard heartbeat still running (an idle worker's lives
                # a round of the shards, workers/idle.py): gone, so that reclaim.lua takes it for dead
                self.r.delete(K.ModelKeys(model).heartbeat(row["name"]))
            res = self.reclaim_consumer(model, row["name"], min_idle_ms=min_idle_ms)
            if res["batches"] or res["deleted"]:
                total["consumers"] += 1
            for k in ("batches", "items", "dead"):
                total[k] += res[k]
        return total
