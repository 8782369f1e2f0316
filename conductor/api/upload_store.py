"""Uploaded files of ``conductor serve``: the bytes in a store directory, the file objects in Redis.

Why a directory and not Redis: a batch input file may be 200 MB, read twice (validation, then
submission) a line at a time; in Redis it would sit in memory next to the queue it feeds, and
the queue's ``maxmemory`` refusals would then refuse uploads too. The directory must be shared by
every replica of ``serve`` behind one load balancer (a network file system, a shared volume):
the replicas keep nothing of their own, the file objects live in Redis (``cdr:file:F``,
``cdr:files``, and the owning tenant's ``cdr:tenant:{T}:files``). Output and error files are not
stored at all: they are the job's results in OpenAI's format (conductor/formats/openai_output.py),
written out while they are downloaded.
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
from conductor.formats.file_lines import iter_checked
from conductor.jobs.tenant_keys import DEFAULT_TENANT
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
CHUNK = 1024 * 1024
# Ids of the files made from a job's results, not stored: file-out-<job>, file-err-<job>.
OUTPUT_PREFIX, ERROR_PREFIX = "file-out-", "file-err-"
# Fields of a file's record that are not OpenAI's: who owns it (issue 35) and its input tokens.
OWNER_FIELDS = ("tenant", "key_id", "input_tokens")


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

    def put(self, src: BinaryIO, filename: str, purpose: str, *, tenant: str = DEFAULT_TENANT, key_id: str = "",
            max_bytes: int = MAX_FILE_BYTES) -> dict[str, Any]:
        """Copy an upload into the store a chunk at a time; refuse it past ``max_bytes`` (the API's
        MAX_FILE_BYTES, or the tenant's max_file_bytes: FileTooLarge). The file belongs to ``tenant``
        (``key_id`` made it); its input tokens are counted once here, for the tenant's
        enqueued-token limit (conductor/jobs/tenant_limits.py)."""
        if purpose != "batch":
            raise BadInput("purpose", f"only 'batch' files are accepted here, got {purpose!r}")
        file_id = "file-" + secrets.token_hex(12)
        tmp = self.root / f".{file_id}.part"
        size = 0
        try:
            with open(tmp, "wb") as out:
                while chunk := src.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(max_bytes)
                    out.write(chunk)
            tokens = count_tokens(tmp)
            os.replace(tmp, self.path(file_id))
        finally:
            tmp.unlink(missing_ok=True)
        obj: dict[str, Any] = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()),
               "filename": (filename or "upload.jsonl")[:255], "purpose": purpose, "status": "processed"}
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(K.file_key(file_id), mapping={**{k: str(v) for k, v in obj.items()}, "tenant": tenant,
                                                 "key_id": key_id, "input_tokens": str(tokens)})
        pipe.zadd(K.FILES_KEY, {file_id: obj["created_at"]})
        pipe.zadd(K.TenantKeys(tenant).files, {file_id: obj["created_at"]})
        pipe.execute()
        return obj

    def _record(self, file_id: str) -> dict[str, str]:
        raw = self.r.hgetall(K.file_key(file_id)) if _plain(file_id) else {}
        return {as_str(k): as_str(v) for k, v in raw.items()}

    def get(self, file_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        """The file's object; None when there is none, or ``tenant`` is given and owns none by that
        id (another tenant's file reads as one that does not exist)."""
        rec = self._record(file_id)
        if not rec or (tenant is not None and rec.get("tenant", DEFAULT_TENANT) != tenant):
            return None
        obj: dict[str, Any] = {k: v for k, v in rec.items() if k not in OWNER_FIELDS}
        for k in ("bytes", "created_at"):
            obj[k] = int(obj[k])
        obj.setdefault("status_details", None)
        obj.setdefault("expires_at", None)
        return obj

    def tenant_of(self, file_id: str) -> str:
        return as_str(self.r.hget(K.file_key(file_id), "tenant"), absent=DEFAULT_TENANT)

    def input_tokens(self, file_id: str) -> int:
        """The file's input tokens: as counted at its upload (a file uploaded before that was counted
        is counted now)."""
        got = self.r.hget(K.file_key(file_id), "input_tokens")
        return int(got) if got is not None else count_tokens(self.path(file_id))

    def list(self, limit: int, after: str | None, tenant: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, as OpenAI lists: every file, or ``tenant``'s."""
        index = K.FILES_KEY if tenant is None else K.TenantKeys(tenant).files
        start = 0
        if after:
            rank = self.r.zrevrank(index, after)
            start = 0 if rank is None else int(rank) + 1  # type: ignore[arg-type]  # an int without WITHSCORE
        ids = [as_str(x) for x in self.r.zrevrange(index, start, start + limit)]
        objs = [o for o in (self.get(i) for i in ids[:limit]) if o]
        return objs, len(ids) > limit

    def lines(self, file_id: str) -> Iterator[bytes]:
        with open(self.path(file_id), "rb") as f:
            yield from f

    def chunks(self, file_id: str) -> Iterator[bytes]:
        with open(self.path(file_id), "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    def delete(self, file_id: str, tenant: str | None = None) -> bool:
        """Delete the file (``tenant``'s only, when given); False when there is none to delete."""
        if not self.get(file_id, tenant):
            return False
        owner = self.tenant_of(file_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(K.file_key(file_id))
        pipe.zrem(K.FILES_KEY, file_id)
        pipe.zrem(K.TenantKeys(owner).files, file_id)
        pipe.execute()
        self.path(file_id).unlink(missing_ok=True)
        return True


class FileTooLarge(BadInput):
    def __init__(self, limit: int) -> None:
        super().__init__("file", f"larger than {limit} bytes, the most this tenant may upload in one file")
        self.limit = limit


def count_tokens(path: str | os.PathLike[str]) -> int:
    """The input tokens of a file's valid lines, as the intake counts them (a line refused later
    counts nothing)."""
    total = 0
    for _, it, _ in iter_checked(str(path), None, parquet=False, build=lambda: False):
        if not isinstance(it, BadInput):
            total += it.input_tokens
    return total


def _plain(file_id: str) -> bool:
    return file_id.startswith("file-") and all(ch.isalnum() or ch == "-" for ch in file_id) and len(file_id) <= 64

