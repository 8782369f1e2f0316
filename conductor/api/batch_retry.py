"""``POST /v1/batches/{id}/retry`` (an extension of OpenAI's Batch API): a batch's cancelled,
expired and failed lines as a new batch, taken from its uploaded input file (conductor/intake/retry.py
chooses them against its answers). The lines go into a new uploaded file (its own ``input_file_id``,
so the new batch has a ledger of its own) and the batch is created as any other
(conductor/api/batches.py), with the old batch's completion window and metadata, and
``metadata.retry_of`` naming it; it belongs to the old batch's tenant (issue 35), whichever key
retries it, and bills that tenant's fair share.

Body (optional): ``{"only": ["cancelled", "expired", "failed"], "include_permanent": false}``.
"""

from __future__ import annotations

import io
from typing import Any

from fastapi import APIRouter, Body, Request

from conductor.api.batches import batch_tenant, create, input_path, is_batch
from conductor.api.errors import ApiError
from conductor.api.gate import identity
from conductor.api.upload_store import FileStore
from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError
from conductor.intake import retry
from conductor.jobs.job_state import describe
from conductor.jobs.tenant_keys import OPEN, Identity


def retry_router(c: Conductor, store: FileStore, owner: str) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches/{batch_id}/retry")
    def retry_batch(batch_id: str, request: Request,
                    body: dict[str, Any] | None = Body(None)) -> dict[str, Any]:  # noqa: B008
        obj = retry_of(c, store, batch_id, body or {}, owner, identity(request))
        request.state.audit_target = obj["id"]
        return obj

    return router


def retry_of(c: Conductor, store: FileStore, batch_id: str, body: dict[str, Any], owner: str,
             ident: Identity = OPEN) -> dict[str, Any]:
    if not is_batch(c, batch_id, ident):
        raise ApiError(404, f"No such batch: {batch_id}", "batch_id")
    only, permanent = body.get("only"), body.get("include_permanent", False)
    if only is not None and (not isinstance(only, list) or not all(isinstance(k, str) for k in only)):
        raise ApiError(400, f"only must be a list of {', '.join(retry.KINDS)}", "only")
    if not isinstance(permanent, bool):
        raise ApiError(400, "include_permanent must be true or false", "include_permanent")
    d = describe(c, batch_id)
    try:
        kinds = retry.parse_only(",".join(only) if only is not None else None, "only")
        p = retry.plan(c, batch_id, input_path(store, d.get("input_file_id")), kinds, permanent)
        meta = retry.retry_metadata(c, batch_id)
    except BadInput as e:
        raise ApiError(400, str(e), e.field) from None
    except ConductorError as e:
        raise ApiError(409, str(e), "batch_id") from None
    if not p.ids:
        raise ApiError(409, f"Nothing to retry in batch {batch_id}: {p.render()}", "batch_id")
    try:
        retry.drop_dead_letters(c, batch_id, p.ids)  # or a dead-letter retry answers them again in the old batch
    except ConductorError as e:
        raise ApiError(409, str(e), "batch_id") from None
    buf = io.BytesIO()
    retry.write_lines(str(input_path(store, d.get("input_file_id"))), p.ids, buf)
    buf.seek(0)
    tenant = batch_tenant(c, batch_id)  # the new batch is the old one's tenant's, whoever retries it
    f = store.put(buf, f"retry_of_{batch_id}.jsonl", "batch", tenant=tenant, key_id=ident.key_id)
    try:
        return create(c, store, {"input_file_id": f["id"], "endpoint": d.get("endpoint"),
                                 "completion_window": d.get("completion_window") or "24h", "metadata": meta}, owner,
                      ident, tenant=tenant)
    except ApiError:
        store.delete(f["id"])  # refused (the tenant's token limit): the file made for it goes too
        raise
