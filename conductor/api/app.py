"""``conductor serve``: OpenAI's Files and Batches API at ``/v1`` and a status page at ``/``.

Stateless: batches are jobs (their lifecycle in ``cdr:job:J:meta``, conductor/jobs/job_state.py), file
objects live in Redis and file bytes in a shared store directory (conductor/api/upload_store.py), so any
number of replicas may serve behind one load balancer. A created batch is validated and submitted
by the replica that took the request, in a thread after the reply (status ``validating``, then
``in_progress``, or ``failed`` with OpenAI-style ``errors`` naming each bad line and field).
Output and error files are the job's results in OpenAI's format, written out while they are
downloaded (``file-out-<batch>``, ``file-err-<batch>``). Every replica ends batches whose
completion window has passed (lifecycle.expire_due, every few seconds; the steps are idempotent).
"""

from __future__ import annotations

import contextlib
import html
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from conductor.api.upload_store import ERROR_PREFIX, OUTPUT_PREFIX, FileStore
from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError
from conductor.intake.formats import CHAT_URL, ENDPOINTS, parse_line
from conductor.jobs import job_state as lifecycle
from conductor.jobs.openai_output import converted
from conductor.redis_contract import keys as K
from conductor.redis_contract.config import ModelDefaults
from conductor.tier.object_store import Store

log = logging.getLogger(__name__)
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
SUBMIT_STEP = 5000  # items per Conductor.submit while a batch's file is submitted
MAX_ERRORS = 1000  # bad lines listed in a failed batch's errors
EXPIRY_EVERY_S = 5.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _err(status: int, message: str, param: str | None = None, code: str | None = None,
         type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


# The route table: each route is a small function of its own, which C901 counts into the factory.
def make_app(redis_url: str, *, data_dir: str | None = None, api_keys: list[str] | None = None,  # noqa: C901
             segment_store: Store | None = None) -> FastAPI:
    """``segment_store``: the disk tier's (conductor/tier/spill.py): a batch's items beyond a model's
    resident_tokens go to it, and its output file reads the results moved there."""
    c = Conductor.from_url(redis_url, store=segment_store)
    store = FileStore(c.r, data_dir)
    keys = {k for k in (api_keys or []) if k}
    stop = threading.Event()

    def expiry_loop() -> None:
        while not stop.wait(EXPIRY_EVERY_S):
            try:
                lifecycle.expire_due(c)
            except Exception as e:  # noqa: BLE001 - a Redis hiccup must not end the loop
                log.warning("expiry sweep: %s", e)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> Any:
        t = threading.Thread(target=expiry_loop, name="expiry", daemon=True)
        t.start()
        yield
        stop.set()
        t.join(5)  # joined, not left to die with the interpreter

    app = FastAPI(title="conductor", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store = store

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Response:
        if keys:
            got = request.headers.get("authorization", "")
            token = got[7:] if got.lower().startswith("bearer ") else request.query_params.get("key", "")
            if not any(secrets.compare_digest(token, k) for k in keys):
                shown = (token[:3] + "*" * 4 + token[-4:]) if len(token) > 8 else "*" * len(token)
                return _err(401, f"Incorrect API key provided: {shown}.", code="invalid_api_key")
        response: Response = await call_next(request)
        return response

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return _err(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(ConductorError)
    async def conductor_error(_request: Request, e: ConductorError) -> JSONResponse:
        return _err(400, str(e), getattr(e, "field", None))

    # ------------------------------------------------------------------ files
    @app.post("/v1/files")
    def upload(file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:  # noqa: B008
        try:
            return store.put(file.file, file.filename or "", purpose)
        except BadInput as e:
            raise ApiError(400, str(e), e.field) from None

    @app.get("/v1/files")
    def list_files(limit: int = 10000, after: str | None = None, purpose: str | None = None) -> dict[str, Any]:
        objs, more = store.list(max(1, min(limit, 10000)), after)
        if purpose:
            objs = [o for o in objs if o["purpose"] == purpose]
        return _page(objs, more)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> dict[str, Any]:
        return _file_obj(file_id)

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str) -> StreamingResponse:
        _file_obj(file_id)
        return StreamingResponse(_content(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict[str, Any]:
        if not store.delete(file_id):
            raise ApiError(404, f"No such File object: {file_id}", "id")
        return {"id": file_id, "object": "file", "deleted": True}

    def _file_obj(file_id: str) -> dict[str, Any]:
        for prefix, failed in ((OUTPUT_PREFIX, False), (ERROR_PREFIX, True)):
            if file_id.startswith(prefix):
                job = file_id[len(prefix):]
                obj = _batch(job) if _is_batch(job) else None
                if obj and file_id in (obj["output_file_id"], obj["error_file_id"]):
                    size = sum(len(chunk) for chunk in _result_lines(job, failed))
                    return {"id": file_id, "object": "file", "bytes": size, "created_at": obj["completed_at"] or
                            obj["cancelled_at"] or obj["expired_at"] or obj["created_at"],
                            "filename": f"batch_{'error' if failed else 'output'}.jsonl", "purpose": "batch_output",
                            "status": "processed", "expires_at": None, "status_details": None}
        obj = store.get(file_id)
        if obj is None:
            raise ApiError(404, f"No such File object: {file_id}", "id")
        return obj

    def _content(file_id: str) -> Iterator[bytes]:
        for prefix, failed in ((OUTPUT_PREFIX, False), (ERROR_PREFIX, True)):
            if file_id.startswith(prefix):
                return _result_lines(file_id[len(prefix):], failed)
        return store.chunks(file_id)

    def _result_lines(job: str, failed: bool) -> Iterator[bytes]:
        for line, bad in converted(c.results(job)):
            if bad == failed:
                yield _enc.encode(line) + b"\n"

    # ------------------------------------------------------------------ batches
    @app.post("/v1/batches")
    def create_batch(body: dict[str, Any]) -> dict[str, Any]:
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
            window_s = lifecycle.parse_window(window)
            meta = lifecycle.check_metadata(body.get("metadata"))
        except BadInput as e:
            raise ApiError(400, str(e), e.field) from None
        job = "batch_" + secrets.token_hex(12)
        lifecycle.start(c.r, job, status="validating", window_s=window_s, window=window, metadata=meta,
                        input_file_id=str(file_id), endpoint=endpoint)
        c.r.zadd(K.BATCHES_KEY, {job: int(time.time())})
        threading.Thread(target=_submit_file, args=(job, file_id, endpoint), name=f"submit-{job}",
                         daemon=True).start()
        return _batch(job)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str) -> dict[str, Any]:
        if not _is_batch(batch_id):
            raise ApiError(404, f"No such batch: {batch_id}", "batch_id")
        return _batch(batch_id)

    @app.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        limit = max(1, min(limit, 100))
        start = 0
        if after:
            rank = c.r.zrevrank(K.BATCHES_KEY, after)
            start = 0 if rank is None else int(rank) + 1  # type: ignore[arg-type]  # an int without WITHSCORE
        ids = [_s(x) for x in c.r.zrevrange(K.BATCHES_KEY, start, start + limit)]
        return _page([_batch(j) for j in ids[:limit]], len(ids) > limit)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str) -> dict[str, Any]:
        if not _is_batch(batch_id):
            raise ApiError(404, f"No such batch: {batch_id}", "batch_id")
        status = lifecycle.describe(c, batch_id)["status"]
        if status == "validating":  # the submitting thread sees it and stops
            lifecycle.set_status(c.r, batch_id, "cancelling", ending="cancelled")
        elif status in lifecycle.TERMINAL and status != "cancelled":
            raise ApiError(409, f"Cannot cancel a batch with status {status}.", "batch_id")
        else:
            lifecycle.cancel(c, batch_id)
        return _batch(batch_id)

    def _is_batch(job: str) -> bool:
        return job.startswith("batch_") and c.r.zscore(K.BATCHES_KEY, job) is not None

    def _batch(job: str) -> dict[str, Any]:
        d = lifecycle.describe(c, job)
        status = d["status"]
        rc = d["request_counts"]
        ended = status in ("completed", "expired", "cancelled")
        errors = msgspec.json.decode(d["errors"]) if d.get("errors") else None
        return {"id": job, "object": "batch", "endpoint": d.get("endpoint") or "/v1/chat/completions",
                "errors": errors, "input_file_id": d.get("input_file_id") or "",
                "completion_window": d.get("completion_window") or "24h", "status": status,
                "output_file_id": f"{OUTPUT_PREFIX}{job}" if ended and rc["completed"] else None,
                "error_file_id": f"{ERROR_PREFIX}{job}" if ended and rc["failed"] else None,
                "created_at": d["created_at"] or 0, "in_progress_at": d["in_progress_at"],
                "expires_at": d["expires_at"], "finalizing_at": d["finalizing_at"], "completed_at": d["completed_at"],
                "failed_at": d["failed_at"], "expired_at": d["expired_at"], "cancelling_at": d["cancelling_at"],
                "cancelled_at": d["cancelled_at"], "request_counts": rc, "metadata": d["metadata"]}

    def _validate(file_id: str, endpoint: str, defaults: ModelDefaults, errors: list[dict[str, Any]]) -> dict[str, int]:
        """Every line read and checked once (ids unique in the file): the items per model."""
        counts: dict[str, int] = {}
        seen: set[str] = set()
        n_bad = 0
        for n, it in _items(file_id, endpoint, defaults, errors):
            if it is None:
                n_bad += 1
                continue
            if it.id in seen:
                n_bad += 1
                _add(errors, n, "custom_id", f"duplicate custom_id {it.id!r}: each line needs a unique one")
                continue
            seen.add(it.id)
            counts[it.model] = counts.get(it.model, 0) + 1
        if not counts and not n_bad:
            _add(errors, None, None, "the input file holds no requests", code="empty_file")
        return counts

    def _submit_file(job: str, file_id: str, endpoint: str) -> None:
        """Validate every line (OpenAI's way: any bad line fails the batch, naming each), then
        submit in steps; a file is read twice rather than held."""
        try:
            defaults = ModelDefaults(lambda: c.r)
            errors: list[dict[str, Any]] = []
            counts = _validate(file_id, endpoint, defaults, errors)
            if errors:
                _fail(job, errors)
                return
            c.declare(job, counts)
            chunk = []
            for _n, it in _items(file_id, endpoint, defaults, None):
                chunk.append(it)
                if len(chunk) >= SUBMIT_STEP:
                    if _cancelled(job):
                        break
                    c.submit(chunk, job)
                    chunk = []
            if chunk and not _cancelled(job):
                c.submit(chunk, job)
            for model in counts:
                c.seal(model)
            if _cancelled(job):
                lifecycle.end(c, job, "cancelled")
            else:
                lifecycle.set_status(c.r, job, "in_progress")
        except Exception as e:  # noqa: BLE001 - whatever stopped it, the batch must say so
            log.warning("batch %s: submit failed: %s", job, e)
            _fail(job, [{"code": "submit_failed", "message": str(e).splitlines()[0] if str(e) else type(e).__name__,
                         "param": None, "line": None}])

    def _items(file_id: str, endpoint: str, defaults: ModelDefaults,
               errors: list[dict[str, Any]] | None) -> Iterator[tuple[int, Any]]:
        for n, raw in enumerate(store.lines(file_id), 1):
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            try:
                it = parse_line(line, n, defaults.max_tokens)
                payload = _dec.decode(it.body)[1]
                if not isinstance(payload, dict) or payload.get("custom_id") != it.id:
                    # a native line parses too; this API takes OpenAI's requests only
                    raise BadInput("custom_id", "missing: each line is an OpenAI batch request", n)
                url = payload.get("url", CHAT_URL)
                if url != endpoint:
                    raise BadInput("url", f"{url} differs from the batch's endpoint {endpoint}", n)
                yield n, it
            except BadInput as e:
                if errors is None:
                    raise
                _add(errors, n, e.field, str(e))
                yield n, None

    def _cancelled(job: str) -> bool:
        return _s(c.r.hget(K.job_meta_key(job), "ending")) == "cancelled"

    def _fail(job: str, errors: list[dict[str, Any]]) -> None:
        lifecycle.set_status(c.r, job, "failed", errors=_enc.encode({"object": "list", "data": errors}).decode())

    # ------------------------------------------------------------------ status page
    @app.get("/", response_class=HTMLResponse)
    def status_page() -> str:
        from conductor.api.status_page import render_page
        return render_page(c)

    return app


def _add(errors: list[dict[str, Any]], line: int | None, param: str | None, message: str,
         code: str = "invalid_request") -> None:
    if len(errors) < MAX_ERRORS:
        errors.append({"code": code, "message": message, "param": param, "line": line})


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else ("" if v is None else str(v))


def _escape(v: Any) -> str:
    return html.escape(str(v))
