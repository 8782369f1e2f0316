"""Uploaded files of ``conductor serve``: the bytes in a store directory, the file objects in Redis.

Why a directory and not Redis: a batch input file may be 200 MB, read twice (validation, then
submission) a line at a time; in Redis it would sit in memory next to the queue it feeds, and
the queue's ``maxmemory`` refusals would then refuse uploads too. The directory must be shared by
every replica of ``serve`` behind one load balancer (a network file system, a shared volume):
the replicas keep nothing of their own, the file objects live in Redis (``cdr:file:F``,
``cdr:files``). Output and error files are not stored at all: they are the job's results in
OpenAI's format (conductor/formats/openai_output.py), written out while they are downloaded.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import redis

from conductor.errors import BadInput
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
CHUNK = 1024 * 1024
# Ids of the files made from a job's results, not stored: file-out-<job>, file-err-<job>.
OUTPUT_PREFIX, ERROR_PREFIX = "file-out-", "file-err-"


def default_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "conductor" / "files"


class FileStore:
    def __init__(self, r: redis.Redis, root: str | os.PathLike[str] | None = None) -> None:
        self.r = r
        self.root = Path(root) if root else default_dir()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    def put(self, src: BinaryIO, filename: str, purpose: str) -> dict[str, Any]:
        """Copy an upload into the store a chunk at a time; refuse it past MAX_FILE_BYTES."""
        if purpose != "batch":
            raise BadInput("purpose", f"only 'batch' files are accepted here, got {purpose!r}")
        file_id = "file-" + secrets.token_hex(12)
        tmp = self.root / f".{file_id}.part"
        size = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := src.read(CHUNK):
                    size += len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise BadInput("file", f"larger than {MAX_FILE_BYTES} bytes")
                    out.write(chunk)
            os.replace(tmp, self.path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        obj: dict[str, Any] = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
               "filename": (filename or "upload.jsonl")[:255], "purpose": purpose, "status": "processed"}
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(K.file_key(file_id), mapping={k: str(v) for k, v in obj.items()})
        pipe.zadd(K.FILES_KEY, {file_id: obj["created_at"]})
        pipe.execute()
        return obj

    def get(self, file_id: str) -> dict[str, Any] | None:
        raw = self.r.hgetall(K.file_key(file_id)) if _plain(file_id) else {}
        if not raw:
            return None
        obj: dict[str, Any] = {as_str(k): as_str(v) for k, v in raw.items()}
        for k in ("bytes", "created_at"):
            obj[k] = int(obj[k])
        obj.setdefault("status_details", None)
        obj.setdefault("expires_at", None)
        return obj

    def list(self, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, as OpenAI lists."""
        start = 0
        if after:
            rank = self.r.zrevrank(K.FILES_KEY, after)
            start = 0 if rank is None else int(rank) + 1  # type: ignore[arg-type]  # an int without WITHSCORE
        ids = [as_str(x) for x in self.r.zrevrange(K.FILES_KEY, start, start + limit)]
        objs = [o for o in (self.get(i) for i in ids[:limit]) if o]
        return objs, len(ids) > limit

    def lines(self, file_id: str) -> Iterator[bytes]:
        with open(self.path(file_id), "rb") as f:
            yield from f

    def chunks(self, file_id: str) -> Iterator[bytes]:
        with open(self.path(file_id), "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def delete(self, file_id: str) -> bool:
        if not self.get(file_id):
            return False
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(K.file_key(file_id))
        pipe.zrem(K.FILES_KEY, file_id)
        pipe.execute()
        self.path(file_id).unlink(missing_ok=True)
        return True


def _plain(file_id: str) -> bool:
    return file_id.startswith("file-") and all(ch.isalnum() or ch == "-" for ch in file_id) and len(file_id) <= 64

