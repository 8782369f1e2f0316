"""A results stream rewound by a failover, as a reader following it by position finds it.

The old primary acknowledged results that never reached its replica, and a reader had read them;
the promoted replica lacks them, and workers produce them again. ``find_rewind`` tells that from
retention (XTRIM) and purges (XDEL), which raise the stream's max-deleted-entry-id past the entry
they remove; a promoted replica never had the entry at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import redis

from conductor.redis_contract.connection import as_str

# Results remembered per stream to skip their second copies after a rewind (a failover loses
# what replication had not carried yet: seconds of results, far below this).
REWIND_WINDOW = 100_000


@dataclass
class Rewind:
    """A results stream found without the entry a reader had read last (``Conductor.results``)."""

    stream: str
    read_up_to: str  # the last entry id this reader had read
    now_at: str  # the newest entry the stream still holds below it ("0-0": none)
    ids: list[str]  # item ids read past now_at: their results will come again, and are skipped
    all_known: bool  # False: the reader read more past now_at than it remembers (REWIND_WINDOW)


def id_key(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def find_rewind(r: Any, stream: str, cursor: str, recent: deque[tuple[str, str]] | None) -> Rewind | None:
    """A Rewind when the entry at ``cursor`` (the last one this reader read) is gone without having
    been deleted, else None. ``recent``: (entry id, item id) of what the reader read, newest last."""
    if cursor == "0-0":
        return None
    pipe = r.pipeline(transaction=False)
    pipe.xrange(stream, cursor, cursor, count=1)
    pipe.xinfo_stream(stream)
    pipe.xrevrange(stream, "(" + cursor, "-", count=1)
    at, info, before = pipe.execute(raise_on_error=False)
    if isinstance(at, list) and at:
        return None
    if isinstance(at, redis.ResponseError) and "no such key" not in str(at).lower():
        raise at
    if isinstance(info, dict) and id_key(as_str(info.get("max-deleted-entry-id", "0-0"))) >= id_key(cursor):
        return None
    kept = as_str(before[0][0]) if isinstance(before, list) and before else "0-0"
    ids = [iid for eid, iid in (recent or ()) if id_key(eid) > id_key(kept)]
    covered = recent is not None and len(recent) > 0 and id_key(recent[0][0]) <= id_key(kept)
    return Rewind(stream=stream, read_up_to=cursor, now_at=kept, ids=ids, all_known=covered)
