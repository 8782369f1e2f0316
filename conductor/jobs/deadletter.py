"""The dead letter: items delivered ``max_deliveries`` times without a result.

Each model keeps one stream (``cdr:{model}:dead``) whose entries hold the item (so it can be
retried without the producer), its job, its delivery count and the last error. Listing and
purging read and delete entries; retrying is one Lua script (lua/dead_retry.lua) so an item
never has two results and its job's counters move with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from conductor.client import Conductor
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import StreamEntry as Entry
from conductor.redis_contract.connection import as_str

_CHUNK = 500


@dataclass(frozen=True)
class DeadItem:
    model: str
    entry: str  # id in the model's dead stream
    id: str
    job: str
    deliveries: int
    error: str
    ms: int

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "entry": self.entry, "id": self.id, "job": self.job,
                "deliveries": self.deliveries, "error": self.error, "ms": self.ms}


def _text(v: bytes) -> str:
    # an entry whose id or error is not UTF-8 is still listed (and can be retried or purged)
    return as_str(v, errors="replace")


class DeadLetter:
    def __init__(self, conductor: Conductor) -> None:
        self.c = conductor

    def _models(self, model: str | None) -> list[str]:
        return [model] if model else self.c.models()

    def items(self, *, model: str | None = None, job: str | None = None) -> Iterator[DeadItem]:
        """Dead-lettered items, oldest first, of one model or all, optionally of one job."""
        for m in self._models(model):
            key = K.ModelKeys(m).dead
            cursor = "-"
            while True:
                rows: list[Entry] = self.c.r.xrange(key, min=cursor, count=_CHUNK)  # type: ignore[assignment]
                for eid, f in rows:
                    if job is not None and _text(f[b"job"]) != job:
                        continue
                    yield DeadItem(model=m, entry=_text(eid), id=_text(f[b"id"]), job=_text(f[b"job"]),
                                   deliveries=int(f[b"deliveries"]), error=_text(f[b"error"]), ms=int(f[b"ms"]))
                if len(rows) < _CHUNK:
                    break
                cursor = "(" + _text(rows[-1][0])

    def _by_model(self, model: str | None, job: str | None, ids: set[str] | None = None) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for d in self.items(model=model, job=job):
            if ids is None or d.id in ids:
                out.setdefault(d.model, []).append(d.entry)
        return out

    def retry(self, *, model: str | None = None, job: str | None = None) -> dict[str, int]:
        """Re-enqueue dead items (served first, deliveries reset); their dead-letter results go."""
        total = {"retried": 0, "skipped": 0}
        for m, entries in self._by_model(model, job).items():
            mk = K.ModelKeys(m)
            for start in range(0, len(entries), _CHUNK):
                done, skipped = calls.dead_retry(mk, entries[start:start + _CHUNK]).run(self.c.scripts)
                total["retried"] += done
                total["skipped"] += skipped
        return total

    def purge(self, *, model: str | None = None, job: str | None = None, ids: set[str] | None = None) -> int:
        """Forget dead entries (with ``ids``, only those of these item ids); the items keep their
        failed results (their jobs stay complete)."""
        n = 0
        for m, entries in self._by_model(model, job, ids).items():
            key = K.ModelKeys(m).dead
            for start in range(0, len(entries), _CHUNK):
                n += int(self.c.r.xdel(key, *entries[start:start + _CHUNK]))
        return n
