"""A job's counters and its result records, read by any process at any time."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import redis

from conductor.client.core import ConductorCore
from conductor.client.rewind import REWIND_WINDOW, Rewind, find_rewind
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import Result, result_decoder
from conductor.redis_contract.shards import fold
from conductor.tier.result_segments import ResultSegments


class JobReads(ConductorCore):
    def status(self, job: str, models: list[str] | None = None) -> dict[str, Any]:
        """Counters of ``job`` over its models (``models``: the job's models when already read)."""
        models = self.job_models(job) if models is None else models
        total: dict[str, Any] = {"job": job, "submitted": 0, "completed": 0, "failed": 0, "pending": 0,
                                 "declared": 0, "lost": 0, "cancelled": 0, "expired": 0, "models": {}}
        pipe = self.r.pipeline(transaction=False)
        for model in models:  # the producer's counts and the workers' (keys.py, schema 3)
            pipe.hmget(K.ModelKeys(model).job_intake(job), "submitted", "declared")
            pipe.hmget(K.ModelKeys(model).job(job), "completed", "failed", "cancelled", "expired")
        got = pipe.execute() if models else []
        for i, model in enumerate(models):
            (sub, dec), (comp, fail, canc, exp) = got[2 * i], got[2 * i + 1]
            # cancelled, expired: of the failed items, those a cancel or an expiry answered (lua/lib_cancel.lua)
            row = {"submitted": int(sub or 0), "completed": int(comp or 0), "failed": int(fail or 0),
                   "declared": int(dec or 0), "cancelled": int(canc or 0), "expired": int(exp or 0)}
            row["pending"] = row["submitted"] - row["completed"] - row["failed"]
            # Items the producer declared before sending them and Redis does not hold (declare.lua).
            row["lost"] = max(0, row["declared"] - row["submitted"])
            total["models"][model] = row
            for k in ("submitted", "completed", "failed", "pending", "declared", "cancelled", "expired"):
                total[k] += row[k]
        # A sharded model's declaration is on the model, its items on its shards (shard_route.py):
        # what is lost is counted over the model's shards together.
        groups: dict[str, list[int]] = {}
        for model, row in total["models"].items():
            g = groups.setdefault(fold(model), [0, 0])
            g[0] += row["declared"]
            g[1] += row["submitted"]
        total["lost"] = sum(max(0, dec - sub) for dec, sub in groups.values())
        total["done"] = bool(models) and total["pending"] == 0
        return total

    def results(self, job: str, *, follow: bool = False, block_ms: int = 1000, count: int = 1000,
                should_stop: Callable[[], bool] | None = None,
                on_rewind: Callable[[Rewind], None] | None = None) -> Iterator[bytes]:
        """Result records (JSON bytes) of ``job``, from any process at any time.

        With ``follow`` it keeps reading until every submitted item has a result (or
        ``should_stop`` says so). A stream rewound by a failover (conductor/client/rewind.py) is reported
        to ``on_rewind``, and the second copies of results already returned past the rewind point
        are skipped: every id once, as far as the last REWIND_WINDOW results per stream reach.
        """
        cursors: dict[Any, Any] = {}  # stream key -> last id read
        recent: dict[str, deque[tuple[str, str]]] = {}  # stream -> (entry id, item id), newest last
        skip: dict[str, set[str]] = {}
        segs: dict[str, ResultSegments] = {}  # stream -> its results moved to the store (disk tier)
        while True:
            models = self.job_models(job)
            self._track(job, models, cursors, segs)
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
                # Each read is checked against the reader's position before anything it brought is
                # returned: a reconnect to a promoted replica answers an XREAD with results done again.
                if self._rewound(reply, cursors, recent, skip, on_rewind):
                    continue  # read again from the rewind point: the results after it are new
                for rec in _new_records(_with_segments(reply, cursors, segs), cursors, recent, skip):
                    got += 1
                    yield rec
            if got:
                continue
            if not follow or done or (should_stop and should_stop()):
                return
            if not cursors:
                time.sleep(block_ms / 1000)

    def _track(self, job: str, models: list[str], cursors: dict[Any, Any], segs: dict[str, ResultSegments]) -> None:
        """Each model's results stream read from its start, with its result segments beside it."""
        for m in models:
            mk = K.ModelKeys(m)
            key = mk.job_results(job)
            cursors.setdefault(key, "0-0")
            if key not in segs:
                segs[key] = ResultSegments(self.r, self.tier.store if self.tier else None, mk.job_rsegs(job))

    def _rewound(self, reply: list[tuple[str, list[Any]]], cursors: dict[Any, Any],
                 recent: dict[str, deque[tuple[str, str]]], skip: dict[str, set[str]],
                 on_rewind: Callable[[Rewind], None] | None) -> bool:
        """Moves the cursor of each rewound stream back to its rewind point; True if any was."""
        found = False
        for stream in {st for st, _e in reply} if reply else set(cursors):
            rw = find_rewind(self.r, stream, cursors[stream], recent.get(stream))
            if rw is not None:
                found = True
                cursors[stream] = rw.now_at
                skip.setdefault(stream, set()).update(rw.ids)
                if on_rewind is not None:
                    on_rewind(rw)
        return found

    def read_results(self, job: str) -> list[Result]:
        return [result_decoder.decode(r) for r in self.results(job)]


def _new_records(reply: list[tuple[str, list[Any]]], cursors: dict[Any, Any],
                 recent: dict[str, deque[tuple[str, str]]], skip: dict[str, set[str]]) -> Iterator[bytes]:
    """The records of one read, each stream's cursor moved past them; a second copy of a result
    already returned before a rewind (``skip``) is left out."""
    for stream, entries in reply:
        seen = recent.setdefault(stream, deque(maxlen=REWIND_WINDOW))
        for eid, fields in entries:
            cursors[stream] = as_str(eid)
            iid = as_str(fields.get(b"id", b""))
            if iid in skip.get(stream, ()):
                skip[stream].discard(iid)
                continue
            seen.append((as_str(eid), iid))
            yield fields[b"r"]


def _with_segments(reply: list[tuple[str, list[Any]]], cursors: dict[Any, Any],
                   segs: dict[str, ResultSegments]) -> list[tuple[str, list[Any]]]:
    """Results that left the stream for store segments before it was read come first, in stream
    order (conductor/tier/result_segments.py): every record once, from either."""
    read = dict(reply)
    return [(st, [*segs[st].between(cursors[st], as_str(read[st][0][0]) if read.get(st) else None),
                  *read.get(st, [])]) for st in cursors]


def stream_reply(reply: Any) -> list[tuple[str, list[Any]]]:
    """XREAD replies are a list under RESP2 and a dict under RESP3."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(as_str(k), v[0] if v and isinstance(v[0], list) and len(v) == 1 and isinstance(v[0][0], list)
                 else v) for k, v in reply.items()]
    return [(as_str(k), v) for k, v in reply]
