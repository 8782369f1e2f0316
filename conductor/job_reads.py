"""A job's counters and its result records, read by any process at any time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from conductor import keys as K
from conductor.client_core import ConductorCore
from conductor.connection import as_str
from conductor.records import Result, result_decoder


class JobReads(ConductorCore):
    def status(self, job: str, models: list[str] | None = None) -> dict[str, Any]:
        """Counters of ``job`` over its models (``models``: the job's models when already read)."""
        models = self.job_models(job) if models is None else models
        total: dict[str, Any] = {"job": job, "submitted": 0, "completed": 0, "failed": 0, "pending": 0,
                                 "declared": 0, "lost": 0, "models": {}}
        for model in models:
            raw = self.r.hgetall(K.ModelKeys(model).job(job))
            row = {k: int(raw.get(k.encode(), 0)) for k in ("submitted", "completed", "failed", "declared")}
            row["pending"] = row["submitted"] - row["completed"] - row["failed"]
            # Items the producer declared before sending them and Redis does not hold (declare.lua).
            row["lost"] = max(0, row["declared"] - row["submitted"])
            total["models"][model] = row
            for k in ("submitted", "completed", "failed", "pending", "declared", "lost"):
                total[k] += row[k]
        total["done"] = bool(models) and total["pending"] == 0
        return total

    def results(self, job: str, *, follow: bool = False, block_ms: int = 1000, count: int = 1000,
                should_stop: Callable[[], bool] | None = None) -> Iterator[bytes]:
        """Result records (JSON bytes) of ``job``, from any process at any time.

        With ``follow`` it keeps reading until every submitted item has a result (or
        ``should_stop`` says so).
        """
        cursors: dict[Any, Any] = {}  # stream key -> last id read
        while True:
            models = self.job_models(job)
            for m in models:
                cursors.setdefault(K.ModelKeys(m).job_results(job), "0-0")
            # Asked before the read: complete.lua writes a result and counts it in one step, so
            # when the job was done before a read that finds nothing, nothing is left to read.
            # Asked after, a batch completed between the two would be missed.
            done = follow and bool(models) and self.status(job, models)["done"]
            got = 0
            if cursors:
                if isinstance(self.r, redis.RedisCluster) and len(cursors) > 1:
                    # A job's models live in different slots: one read per stream, none blocking.
                    reply = [row for key, cur in list(cursors.items())
                             for row in stream_reply(self.r.xread({key: cur}, count=count))]
                    if not reply and follow:
                        time.sleep(min(block_ms, 200) / 1000)
                else:
                    reply = stream_reply(self.r.xread(cursors, count=count, block=block_ms if follow else None))
                for stream, entries in reply:
                    for eid, fields in entries:
                        cursors[stream] = as_str(eid)
                        got += 1
                        yield fields[b"r"]
            if got:
                continue
            if not follow or done or (should_stop and should_stop()):
                return
            if not cursors:
                time.sleep(block_ms / 1000)

    def read_results(self, job: str) -> list[Result]:
        return [result_decoder.decode(r) for r in self.results(job)]


def stream_reply(reply: Any) -> list[tuple[str, list[Any]]]:
    """XREAD replies are a list under RESP2 and a dict under RESP3."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(as_str(k), v[0] if v and isinstance(v[0], list) and len(v) == 1 and isinstance(v[0][0], list)
                 else v) for k, v in reply.items()]
    return [(as_str(k), v) for k, v in reply]
