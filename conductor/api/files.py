"""The Files API (``/v1/files``): uploads kept in the upload store (conductor/api/upload_store.py),
and a batch's output and error files, which are not stored: its results in OpenAI's format, written
out while they are downloaded (``file-out-<batch>``, ``file-err-<batch>``). A key sees its tenant's
files only (an output or error file is its batch's tenant's); an admin key sees every tenant's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import StreamingResponse

from conductor.api.batches import batch_object, is_batch, result_lines
from conductor.api.errors import ApiError, page
from conductor.api.gate import identity
from conductor.api.upload_store import ERROR_PREFIX, MAX_FILE_BYTES, OUTPUT_PREFIX, FileStore, FileTooLarge
from conductor.client import Conductor
from conductor.errors import BadInput
from conductor.jobs import tenant_limits
from conductor.jobs.tenant_keys import OPEN, Identity


def files_router(c: Conductor, store: FileStore) -> APIRouter:
    router = APIRouter()

    def too_large(limit: int) -> ApiError:
        return ApiError(413, f"File too large: at most {limit} bytes for this tenant (its max_file_bytes, or the "
                             f"API's {MAX_FILE_BYTES})", "file", code="file_too_large")

    @router.post("/v1/files")
    def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:  # noqa: B008
        ident = identity(request)
        own = tenant_limits.limits_of(c.r, ident.tenant).max_file_bytes
        limit = min(own, MAX_FILE_BYTES) if own else MAX_FILE_BYTES
        try:
            obj = store.put(file.file, file.filename or "", purpose, tenant=ident.tenant, key_id=ident.key_id,
                            max_bytes=limit)
        except FileTooLarge as e:
            raise too_large(e.limit) from None
        except BadInput as e:
            raise ApiError(400, str(e), e.field) from None
        request.state.audit_target = obj["id"]
        return obj

    @router.get("/v1/files")
    def list_files(request: Request, limit: int = 10000, after: str | None = None,
                   purpose: str | None = None) -> dict[str, Any]:
        objs, more = store.list(max(1, min(limit, 10000)), after, viewer(identity(request)))
        if purpose:
            objs = [o for o in objs if o["purpose"] == purpose]
        return page(objs, more)

    @router.get("/v1/files/{file_id}")
    def get_file(file_id: str, request: Request) -> dict[str, Any]:
        return file_object(c, store, file_id, identity(request))

    @router.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, request: Request) -> StreamingResponse:
        file_object(c, store, file_id, identity(request))
        return StreamingResponse(_content(c, store, file_id), media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        if not store.delete(file_id, viewer(identity(request))):
            raise ApiError(404, f"No such File object: {file_id}", "id")
        return {"id": file_id, "object": "file", "deleted": True}

    return router


def viewer(ident: Identity) -> str | None:
    """The tenant whose files a key sees: its own; None (every tenant's) for an admin."""
    return None if ident.admin else ident.tenant


def file_object(c: Conductor, store: FileStore, file_id: str, ident: Identity = OPEN) -> dict[str, Any]:
    """An uploaded file's object, or the output or error file of an ended batch; else 404 (another
    tenant's file too: the same reply, so that a key cannot tell which ids exist)."""
    for prefix, failed in ((OUTPUT_PREFIX, False), (ERROR_PREFIX, True)):
        if file_id.startswith(prefix):
            job = file_id[len(prefix):]
            obj = batch_object(c, job, store) if is_batch(c, job, ident) else None
            if obj and file_id in (obj["output_file_id"], obj["error_file_id"]):
                written = _written(store, obj, file_id)
                size = written.stat().st_size if written else sum(
                    len(chunk) for chunk in result_lines(c, job, failed, store))
                return {"id": file_id, "object": "file", "bytes": size, "created_at": obj["completed_at"] or
                        obj["cancelled_at"] or obj["expired_at"] or obj["created_at"],
                        "filename": f"batch_{'error' if failed else 'output'}.jsonl", "purpose": "batch_output",
                        "status": "processed", "expires_at": None, "status_details": None}
    obj = store.get(file_id, viewer(ident))
    if obj is None:
        raise ApiError(404, f"No such File object: {file_id}", "id")
    return obj


def _written(store: FileStore, obj: dict[str, Any], file_id: str) -> Path | None:
    """The file the finalizer wrote for a completed batch (conductor/api/finalize.py), if any."""
    path = store.path(file_id)
    return path if obj["status"] == "completed" and path.exists() else None


def _content(c: Conductor, store: FileStore, file_id: str) -> Iterator[bytes]:
    for prefix, failed in ((OUTPUT_PREFIX, False), (ERROR_PREFIX, True)):
        if file_id.startswith(prefix):
            job = file_id[len(prefix):]
            if _written(store, batch_object(c, job, store), file_id):
                return store.chunks(file_id)
            return result_lines(c, job, failed, store)
    return store.chunks(file_id)
