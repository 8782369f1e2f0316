"""Results of the disk tier: a job's finished results beyond a window move to the store.

With a store and a model's ``results_window`` above 0 (or ``results_age_s``: records older than
that many seconds), the worker holding the maintenance lease moves the oldest result records of
each of the model's jobs past that many, in segments of at
most SEGMENT_RESULTS, from the job's stream ``M:job:J:results`` to a Parquet file (columns
``eid``, the stream id, ``id``, the item id, and ``r``, the record as complete.lua wrote it), registered in the list
``M:job:J:rsegs`` by lua/offload_results.lua in the same step as the entries leave the stream.
``Conductor.results`` reads the segments, then the stream, and yields every record once
(``ResultSegments.between``): the same lines as without the tier.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import redis

from conductor.errors import ConductorError
from conductor.redis_contract import keys as K
from conductor.redis_contract import rules
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import StreamEntry, as_str
from conductor.redis_contract.scripts import ScriptClient
from conductor.tier.object_store import Store
from conductor.tier.parquet_bytes import read_bytes, table_bytes

SEGMENT_RESULTS = rules.MAX_CALL_ITEMS


def _id_key(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def encode(model: str, job: str, eids: list[str], iids: list[bytes], recs: list[bytes]) -> bytes:
    import pyarrow as pa
    return table_bytes({"eid": pa.array(eids, pa.string()), "id": pa.array(iids, pa.binary()),
                        "r": pa.array(recs, pa.binary())},
                       {b"conductor": json.dumps({"v": 1, "model": model, "job": job}).encode()})


def decode(data: bytes) -> list[tuple[str, bytes, bytes]]:
    t = read_bytes(data)
    return list(zip(t.column("eid").to_pylist(), t.column("id").to_pylist(), t.column("r").to_pylist(),
                    strict=True))


def offload_job(r: redis.Redis, scripts: Any, store: Store, model: str, job: str, window: int,
                before_ms: int = 0) -> int:
    """Move the job's oldest results past ``window``, and those written before ``before_ms`` (a
    time in ms; 0: none), to the store; the records moved."""
    mk = K.ModelKeys(model)
    stream = mk.job_results(job)
    moved = 0
    while True:
        extra = r.xlen(stream) - window
        if before_ms > 0:
            old = r.xrange(stream, "-", f"{before_ms - 1}", count=SEGMENT_RESULTS)
            extra = max(extra, len(old))  # type: ignore[arg-type]
        if extra <= 0:
            return moved
        entries: list[StreamEntry] = r.xrange(stream, "-", "+", count=min(extra, SEGMENT_RESULTS))  # type: ignore[assignment]
        eids = [as_str(e) for e, _f in entries]
        data = encode(model, job, eids, [f.get(b"id", b"") for _e, f in entries], [f[b"r"] for _e, f in entries])
        name = hashlib.sha1(data).hexdigest()[:rules.SEGMENT_NAME_HEX]
        path = f"results/{name[:2]}/{name}.parquet"
        store.put(path, data)
        record = json.dumps({"path": path, "first": eids[0], "last": eids[-1], "n": len(eids),
                             "sum": hashlib.sha1(data).hexdigest()}, separators=(",", ":"))
        n = calls.offload_results(mk, job, record, eids).run(scripts)
        if n == 0:
            store.delete(path)  # another offload moved them first
            return moved
        moved += n


def offload_model(c: ScriptClient, store: Store, model: str) -> int:
    """Every job of ``model`` over the model's results_window, and its results older than
    results_age_s (0: off, both)."""
    mk = K.ModelKeys(model)
    raw_window, raw_age = c.r.hmget(mk.cfg, ["results_window", "results_age_s"])
    window, age_s = (int(as_str(v)) if v is not None and as_str(v).isdigit() else 0 for v in (raw_window, raw_age))
    if window <= 0 and age_s <= 0:
        return 0
    sec, usec = c.r.time()  # the server's clock: stream ids are its milliseconds
    before_ms = int(sec) * 1000 + int(usec) // 1000 - age_s * 1000 if age_s > 0 else 0
    moved = 0
    for job in (as_str(j) for j in c.r.zrange(K.JOBS_KEY, 0, -1)):
        if c.r.sismember(K.job_models_key(job), model):
            moved += offload_job(c.r, c.scripts, store, model, job, window if window > 0 else 1 << 62, before_ms)
    return moved


@dataclass
class ResultSegments:
    """A reader's position in one stream's result segments (Conductor.results)."""

    r: redis.Redis
    store: Store | None
    rsegs: str
    done: int = 0  # segments wholly before the reader's position
    _cached: tuple[str, list[tuple[str, bytes, bytes]]] | None = None

    def between(self, after: str, before: str | None) -> list[tuple[str, dict[bytes, bytes]]]:
        """Stream entries (id, fields) held in segments, with ids after ``after`` (the reader's
        position) and, when given, before ``before`` (the first id its stream read returned):
        those the stream no longer held when it was read."""
        recs = self.r.lrange(self.rsegs, self.done, -1)
        out: list[tuple[str, dict[bytes, bytes]]] = []
        lo = _id_key(after)
        hi = _id_key(before) if before else None
        for raw in recs:
            rec = json.loads(raw)
            if _id_key(rec["last"]) <= lo:
                self.done += 1  # read already: segments are in stream order
                continue
            if hi is not None and _id_key(rec["first"]) >= hi:
                break  # the stream read has these (it ran before they moved)
            for eid, iid, body in self._entries(rec):
                k = _id_key(eid)
                if k > lo and (hi is None or k < hi):
                    out.append((eid, {b"id": iid, b"r": body}))
        return out

    def _entries(self, rec: dict[str, Any]) -> list[tuple[str, bytes, bytes]]:
        if self._cached is not None and self._cached[0] == rec["path"]:
            return self._cached[1]
        if self.store is None:
            raise ConductorError(f"{self.rsegs}: results of this job are in a store: give it (--store URL or "
                                 "CONDUCTOR_STORE) to read them")
        data = self.store.get(rec["path"])
        if hashlib.sha1(data).hexdigest() != rec["sum"]:
            raise ConductorError(f"result segment {rec['path']} is damaged (its SHA-1 is not the registered one)")
        entries = decode(data)
        self._cached = (rec["path"], entries)
        return entries
