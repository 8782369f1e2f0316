"""The Batches API (``/v1/batches``): a batch is a job whose input is an uploaded file.

A created batch is checked and submitted by the replica that took the request, in a thread after
the reply (status ``validating``, then ``in_progress``, or ``failed`` with OpenAI-style ``errors``
naming each bad line and field), through the same intake as ``conductor submit``
(conductor/intake/file_intake.py): every line checked, then every refusal Redis would give asked
before the first write, then the items sent in chunks. Its lifecycle is the job's
(conductor/jobs/job_state.py); its output and error files are its results
(conductor/api/files.py)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from fastapi import APIRouter

from conductor.api.errors import ApiError, page
from conductor.api.upload_store import ERROR_PREFIX, OUTPUT_PREFIX, FileStore
from conductor.client import Conductor
from conductor.errors import BadInput
from conductor.intake.file_intake import prepare_job, send_file
from conductor.intake.formats import CHAT_URL, ENDPOINTS
from conductor.intake.input_files import FileScan, LineCheck, scan
from conductor.jobs import job_state
from conductor.jobs.openai_output import converted
from conductor.redis_contract import keys as K
from conductor.redis_contract.config import ModelDefaults
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import JobClass, PreparedItem
from conductor.verify import job_ledger

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
MAX_ERRORS = 1000  # bad lines listed in a failed batch's errors


def batches_router(c: Conductor, store: FileStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches")
    def create_batch(body: dict[str, Any]) -> dict[str, Any]:
        return create(c, store, body)

    @router.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict[str, Any]:
        if not is_batch(c, batch_id):
            raise ApiError(404, f"No such batch: {batch_id}", "batch_id")
        return batch_object(c, batch_id, store)

    @router.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        limit = max(1, min(limit, 100))
        start = 0
        if after:
            rank = c.r.zrevrank(K.BATCHES_KEY, after)
            start = 0 if rank is None else int(rank) + 1  # type: ignore[arg-type]  # an int without WITHSCORE
        ids = [as_str(x) for x in c.r.zrevrange(K.BATCHES_KEY, start, start + limit)]
        return page([batch_object(c, j, store) for j in ids[:limit]], len(ids) > limit)

    @router.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        return cancel(c, batch_id, store)

    return router


def create(c: Conductor, store: FileStore, body: dict[str, Any]) -> dict[str, Any]:
    """A new batch (status ``validating``) whose file is submitted by a thread of its own."""
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    found = store.get(file_id) if isinstance(file_id, str) else None
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
        # metadata.tenant bills the batch to a tenant (issue 26); its completion window is its deadline
        job_class = JobClass(meta.get("tenant", ""), "batch", int((time.time() + window_s) * 1000))
    except BadInput as e:
        raise ApiError(400, str(e), f"metadata.{e.field}" if e.field == "tenant" else e.field) from None
    job = "batch_" + secrets.token_hex(12)
    job_state.start(c.r, job, status="validating", window_s=window_s, window=window, metadata=meta,
                    input_file_id=str(file_id), endpoint=endpoint)
    c.r.zadd(K.BATCHES_KEY, {job: int(time.time())})
    threading.Thread(target=submit_batch_file, args=(c, store, job, file_id, endpoint, job_class),
                     name=f"submit-{job}", daemon=True).start()
    return batch_object(c, job, store)


def cancel(c: Conductor, batch_id: str, store: FileStore | None = None) -> dict[str, Any]:
    if not is_batch(c, batch_id):
        raise ApiError(404, f"No such batch: {batch_id}", "batch_id")
    status = job_state.describe(c, batch_id)["status"]
    if status in job_state.TERMINAL and status != "cancelled":
        raise ApiError(409, f"Cannot cancel a batch with status {status}.", "batch_id")
    # validating too: what was sent is answered now, the submitting thread (if any) sees the end and
    # stops, and the lines never sent are answered by the end (conductor/verify/job_ledger.py)
    job_state.cancel(c, batch_id)
    return batch_object(c, batch_id, store)


def is_batch(c: Conductor, job: str) -> bool:
    return job.startswith("batch_") and c.r.zscore(K.BATCHES_KEY, job) is not None


def batch_object(c: Conductor, job: str, store: FileStore | None = None) -> dict[str, Any]:
    """The batch as OpenAI describes one (its moves the counters call for made first). A batch that
    ended early counts every line of its input: those never submitted failed with the end's code."""
    d = job_state.describe(c, job)
    status = d["status"]
    rc = d["request_counts"]
    if store is not None and status in ("cancelled", "expired"):
        rc = job_ledger.ended_counts(c, job, rc, input_path(store, d.get("input_file_id")))
    ended = status in ("completed", "expired", "cancelled")
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


def _openai_request(endpoint: str) -> LineCheck:
    def check(n: int, it: PreparedItem) -> None:
        payload = _dec.decode(it.body)[1]
        if not isinstance(payload, dict) or payload.get("custom_id") != it.id:
            # a native line parses too; this API takes OpenAI's requests only
            raise BadInput("custom_id", "missing: each line is an OpenAI batch request", n)
        url = payload.get("url", CHAT_URL)
        if url != endpoint:
            raise BadInput("url", f"{url} differs from the batch's endpoint {endpoint}", n)
    return check


def submit_batch_file(c: Conductor, store: FileStore, job: str, file_id: str, endpoint: str,
                      job_class: JobClass | None = None) -> None:
    """Check every line (OpenAI's way: any bad line fails the batch, naming each), ask what Redis
    would refuse, then submit in steps; a file is read in passes rather than held."""
    try:
        found = scan(str(store.path(file_id)), default_max_tokens=ModelDefaults(lambda: c.r).max_tokens,
                     check=_openai_request(endpoint), id_field="custom_id", shown=MAX_ERRORS, parquet=False)
        errors = _errors(found)
        if errors:
            _fail(c, job, errors)
            return
        prepare_job(c, found, job, job_class)
        send_file(c, found, job, should_stop=lambda: bool(_ending(c, job)))
        ending = _ending(c, job)
        if ending:  # cancelled or expired while it was sent: what came in meanwhile is answered too
            job_state.end(c, job, ending)
        else:
            job_state.set_status(c.r, job, "in_progress")
    except Exception as e:  # noqa: BLE001 - whatever stopped it, the batch must say so
        log.warning("batch %s: submit failed: %s", job, e)
        _fail(c, job, [{"code": "submit_failed", "message": str(e).splitlines()[0] if str(e) else type(e).__name__,
                        "param": None, "line": None}])


def _errors(found: FileScan) -> list[dict[str, Any]]:
    """The refused lines in line order, as a batch's ``errors`` lists them."""
    if not found.counts and not found.refused:
        return [{"code": "empty_file", "message": "the input file holds no requests", "param": None, "line": None}]
    return [{"code": "invalid_request", "message": str(e), "param": e.field, "line": e.line}
            for e in sorted(found.refusals, key=lambda e: e.line or 0)]


def _ending(c: Conductor, job: str) -> str:
    """'cancelled' or 'expired' once the batch is being ended, else ''."""
    return as_str(c.r.hget(K.job_meta_key(job), "ending"), absent="")


def _fail(c: Conductor, job: str, errors: list[dict[str, Any]]) -> None:
    job_state.set_status(c.r, job, "failed", errors=_enc.encode({"object": "list", "data": errors}).decode())
