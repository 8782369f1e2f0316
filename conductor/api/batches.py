"""The Batches API (``/v1/batches``): a batch is a job whose input is an uploaded file.

A created batch's intake is a task recorded in Redis (conductor/intake/intake_task.py) before the
reply, run by a thread of the replica that took the request (status ``validating``, then
``in_progress``, or ``failed`` with OpenAI-style ``errors`` naming each bad line and field), through
the same intake as ``conductor submit`` (conductor/intake/intake_run.py): every line checked, then
every refusal Redis would give asked before the first write, then the items sent in chunks, the
cursor recorded after each. A replica that dies mid-intake leaves the task to any other (or a
restarted one): its resumer (conductor/intake/intake_resume.py) takes the lapsed lease and goes on
from the cursor. Its lifecycle is the job's (conductor/jobs/job_state.py); its output and error
files are its results (conductor/api/files.py).

A batch belongs to a tenant (issue 35; ``tenant`` and ``key_id`` in its job meta, and the index
``cdr:tenant:{T}:batches``): a user key's own tenant's, and only such a key sees it; another
tenant's batch is a 404 like one that does not exist. Its input tokens count against the tenant's
enqueued-token limit until it ends (conductor/jobs/tenant_limits.py)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from fastapi import APIRouter, Request

from conductor.api.errors import ApiError, page
from conductor.api.gate import identity
from conductor.api.upload_store import ERROR_PREFIX, OUTPUT_PREFIX, FileStore
from conductor.client import Conductor
from conductor.errors import BadInput
from conductor.formats.openai_input import CHAT_URL, ENDPOINTS
from conductor.formats.openai_output import converted
from conductor.intake.intake_run import run as run_task
from conductor.intake.intake_task import Task
from conductor.intake.intake_task import create as create_task
from conductor.jobs import job_ledger, job_state, tenant_limits
from conductor.jobs.tenant_keys import DEFAULT_TENANT, OPEN, Identity, check_tenant
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import JobClass

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()


def batches_router(c: Conductor, store: FileStore, owner: str) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches")
    def create_batch(body: dict[str, Any], request: Request) -> dict[str, Any]:
        obj = create(c, store, body, owner, identity(request))
        request.state.audit_target = obj["id"]
        return obj

    @router.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        if not is_batch(c, batch_id, identity(request)):
            raise ApiError(404, f"No such batch: {batch_id}", "batch_id")
        return batch_object(c, batch_id, store)

    @router.get("/v1/batches")
    def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        ident = identity(request)
        # a user key's own tenant's index: another tenant's batches are not there to skip
        index = K.BATCHES_KEY if ident.admin else K.TenantKeys(ident.tenant).batches
        limit = max(1, min(limit, 100))
        start = 0
        if after:
            rank = c.r.zrevrank(index, after)
            start = 0 if rank is None else int(rank) + 1  # type: ignore[arg-type]  # an int without WITHSCORE
        ids = [as_str(x) for x in c.r.zrevrange(index, start, start + limit)]
        return page([batch_object(c, j, store) for j in ids[:limit]], len(ids) > limit)

    @router.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        return cancel(c, batch_id, store, identity(request))

    return router


def tenant_for(ident: Identity, meta: dict[str, str]) -> tuple[str, str]:
    """(the tenant that owns a new batch, the tenant its fair share bills): a user key's own, whatever
    ``metadata.tenant`` says (another tenant's name is refused); an admin's the one
    ``metadata.tenant`` names, else its own. An open serve bills a batch without one to itself, as
    before keys (the job is its own tenant, '')."""
    named = meta.get("tenant", "")
    if not ident.admin and named and named != ident.tenant:
        raise ApiError(400, f"metadata.tenant: this key belongs to tenant {ident.tenant!r}; it cannot create "
                            f"batches for {named!r}", "metadata.tenant")
    tenant = named if ident.admin and named else ident.tenant
    return tenant, ("" if ident.open and not named else tenant)


def create(c: Conductor, store: FileStore, body: dict[str, Any], owner: str, ident: Identity = OPEN,
           tenant: str | None = None) -> dict[str, Any]:
    """A new batch (status ``validating``) whose intake task, recorded before the reply, is run by a
    thread of its own (``owner``: this replica, holding the task's lease). ``ident`` creates it, for
    ``tenant`` (default: as tenant_for says). Every refusal comes before the first write; the first
    is the tenant's admission (its enqueued-token limit: 429 token_limit_exceeded)."""
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    found = store.get(file_id, None if ident.admin else ident.tenant) if isinstance(file_id, str) else None
    if found is None:
        raise ApiError(400, f"No such File object: {file_id}", "input_file_id")
    if found["purpose"] != "batch":
        raise ApiError(400, "input_file_id must name a file with purpose 'batch'", "input_file_id")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
    window = body.get("completion_window", "24h")
    try:
        window_s = job_state.parse_window(window)
        meta = job_state.check_metadata(body.get("metadata"))
        owned, billed = tenant_for(ident, meta)
        if tenant is not None:  # a retry: the old batch's tenant (an open serve's own-tenant batch stays its own)
            owned, billed = tenant, (tenant if billed else "")
        # the batch bills its tenant's fair share (issue 26); its completion window is its deadline
        job_class = JobClass(billed, "batch", int((time.time() + window_s) * 1000))
        check_tenant(owned)
    except BadInput as e:
        raise ApiError(400, str(e), f"metadata.{e.field}" if e.field == "tenant" else e.field) from None
    job = "batch_" + secrets.token_hex(12)
    tokens = store.input_tokens(str(file_id))
    limit = tenant_limits.limits_of(c.r, owned).max_enqueued_tokens
    admitted, used = tenant_limits.admit(c, owned, job, tokens, limit)
    if not admitted:
        raise ApiError(429, f"Enqueued token limit reached for tenant {owned}: its batches not yet ended hold "
                            f"{used} input tokens, this one {tokens}, the limit is {limit}. Wait for some to end, "
                            "or ask for a higher limit.", "input_file_id", code="token_limit_exceeded")
    try:
        # The intake task first: a replica killed before it answers leaves no batch listed that nothing
        # would ever submit (the task alone is resumed and runs to its end; the caller saw no batch).
        create_task(c, Task(job=job, source="api", path=str(store.path(str(file_id)).resolve()), file_id=str(file_id),
                            endpoint=str(endpoint), job_class=job_class), owner)
    except Exception:
        tenant_limits.release(c.r, owned, job)  # nothing of the batch written: its admission goes too
        raise
    job_state.start(c.r, job, status="validating", window_s=window_s, window=window, metadata=meta,
                    input_file_id=str(file_id), endpoint=endpoint, finalize="1", tenant=owned, key_id=ident.key_id)
    now = int(time.time())
    pipe = c.r.pipeline(transaction=False)
    pipe.zadd(K.BATCHES_OPEN_KEY, {job: now})  # the finalizer's (conductor/api/finalize.py)
    pipe.zadd(K.BATCHES_KEY, {job: now})
    pipe.zadd(K.TenantKeys(owned).batches, {job: now})
    pipe.execute()
    threading.Thread(target=run_task, args=(c, job, owner), name=f"submit-{job}", daemon=True).start()
    return batch_object(c, job, store)


def cancel(c: Conductor, batch_id: str, store: FileStore | None = None, ident: Identity = OPEN) -> dict[str, Any]:
    if not is_batch(c, batch_id, ident):
        raise ApiError(404, f"No such batch: {batch_id}", "batch_id")
    status = job_state.describe(c, batch_id)["status"]
    if status in job_state.TERMINAL and status != "cancelled":
        raise ApiError(409, f"Cannot cancel a batch with status {status}.", "batch_id")
    # validating too: what was sent is answered now, the submitting thread (if any) sees the end and
    # stops, and the lines never sent are answered by the end (conductor/jobs/job_ledger.py)
    job_state.cancel(c, batch_id)
    return batch_object(c, batch_id, store)


def batch_tenant(c: Conductor, job: str) -> str:
    """The tenant that owns a batch (one made before tenants: the default tenant's)."""
    return as_str(c.r.hget(K.job_meta_key(job), "tenant"), absent=DEFAULT_TENANT)


def is_batch(c: Conductor, job: str, ident: Identity = OPEN) -> bool:
    """Whether ``job`` is a batch ``ident`` may see: another tenant's reads as none at all."""
    if not (job.startswith("batch_") and c.r.zscore(K.BATCHES_KEY, job) is not None):
        return False
    return ident.admin or batch_tenant(c, job) == ident.tenant


def batch_object(c: Conductor, job: str, store: FileStore | None = None) -> dict[str, Any]:
    """The batch as OpenAI describes one (its moves the counters call for made first). A batch that
    ended early counts every line of its input: those never submitted failed with the end's code."""
    d = job_state.describe(c, job)
    status = d["status"]
    rc = d["request_counts"]
    if store is not None and status in ("cancelled", "expired"):
        rc = job_ledger.ended_counts(c, job, rc, input_path(store, d.get("input_file_id")))
    ended = status in ("completed", "expired", "cancelled")  # (finalizing: the files are being written)
    errors = msgspec.json.decode(d["errors"]) if d.get("errors") else None
    return {"id": job, "object": "batch", "endpoint": d.get("endpoint") or CHAT_URL,
            "errors": errors, "input_file_id": d.get("input_file_id") or "",
            "completion_window": d.get("completion_window") or "24h", "status": status,
            "output_file_id": f"{OUTPUT_PREFIX}{job}" if ended and rc["completed"] else None,
            "error_file_id": f"{ERROR_PREFIX}{job}" if ended and rc["failed"] else None,
            "created_at": d["created_at"] or 0, "in_progress_at": d["in_progress_at"],
            "expires_at": d["expires_at"], "finalizing_at": d["finalizing_at"], "completed_at": d["completed_at"],
            "failed_at": d["failed_at"], "expired_at": d["expired_at"], "cancelling_at": d["cancelling_at"],
            "cancelled_at": d["cancelled_at"], "request_counts": rc, "metadata": d["metadata"]}


def result_lines(c: Conductor, job: str, failed: bool, store: FileStore | None = None) -> Iterator[bytes]:
    """The lines of a batch's output file (``failed`` False) or error file, in OpenAI's format; the
    error file of a batch that ended early also answers each line never submitted."""
    answered: set[str] = set()
    for line, bad in converted(c.results(job)):
        answered.add(line["custom_id"])
        if bad == failed:
            yield _enc.encode(line) + b"\n"
    if failed and store is not None:
        file_id = as_str(c.r.hget(K.job_meta_key(job), "input_file_id"), absent="")
        for line in job_ledger.unsent_lines(c, job, answered, input_path(store, file_id)):
            yield _enc.encode(line) + b"\n"


def input_path(store: FileStore, file_id: str | None) -> str | None:
    """Where the batch's input file is kept (None when it has none, or it was deleted)."""
    return str(store.path(file_id)) if file_id and store.get(file_id) else None

