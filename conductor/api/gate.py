"""Who a request is, what it may do, and the record of what it did (issue 35): the middleware in front
of every route of ``conductor serve``.

1. The key: ``Authorization: Bearer <key>`` (or ``?key=`` for the status page in a browser), one
   header at most, looked up in the replica's KeyBook (conductor/jobs/tenant_keys.py: the keys in
   Redis, answers cached half a second, and the ``--api-key`` ones). Anything else is a 401 with
   OpenAI's body, nothing written. A replica with no key anywhere serves everyone as an admin of
   the default tenant (``open``), as before keys existed.
2. The tenant's rate (conductor/jobs/tenant_limits.py ``requests_per_minute``): over it, 429 with
   Retry-After.
3. The route runs with ``request.state.identity``; the routes themselves keep each tenant to its
   own files and batches (conductor/api/files.py, batches.py).
4. A create, cancel, retry, download or delete is recorded (conductor/api/audit.py) with its
   status and error code; a route names what it created in ``request.state.audit_target``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable

import redis
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from conductor.api import audit
from conductor.api.errors import ApiError, error_reply
from conductor.jobs import tenant_limits
from conductor.jobs.tenant_keys import OPEN, Identity, KeyBook

log = logging.getLogger(__name__)
LIMITS_TTL_S = 0.5  # a tenant's limits are read again after this long
MULTIPART_SLACK = 64 * 1024  # an upload's form fields and boundaries around the file's bytes, at most


def identity(request: Request) -> Identity:
    """The identity the gate found for this request (a route behind the gate always has one)."""
    ident: Identity = request.state.identity
    return ident


class _LimitCache:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._got: dict[str, tuple[float, tenant_limits.Limits]] = {}
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> tenant_limits.Limits:
        now = time.monotonic()
        with self._lock:
            hit = self._got.get(tenant)
        if hit is not None and now - hit[0] <= LIMITS_TTL_S:
            return hit[1]
        lim = tenant_limits.limits_of(self.r, tenant)
        with self._lock:
            if len(self._got) > 10_000:
                self._got.clear()
            self._got[tenant] = (now, lim)
        return lim


def _token(request: Request) -> str | None:
    """The presented key; None when two Authorization headers came (which one would count?)."""
    got = request.headers.getlist("authorization")
    if len(got) > 1:
        return None
    if got:
        scheme, _, token = got[0].partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""
    return request.query_params.get("key", "")


def install(app: FastAPI, r: redis.Redis, book: KeyBook) -> None:
    limits = _LimitCache(r)

    def who(request: Request) -> tuple[Identity | None, int, tenant_limits.Limits]:
        """(the identity or None: no valid key; the seconds it must wait, 0: none; its tenant's limits)."""
        if book.open():  # no key anywhere: whatever a client sends (the SDK always sends one), as before keys
            return OPEN, 0, tenant_limits.Limits()
        token = _token(request)
        ident = book.identify(token) if token is not None else None
        if ident is None:
            return None, 0, tenant_limits.Limits()
        lim = limits(ident.tenant)
        wait = tenant_limits.take_request(r, ident.tenant, lim.requests_per_minute) if lim.requests_per_minute else 0
        return ident, wait, lim

    @app.middleware("http")
    async def gate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        try:
            ident, wait, lim = await run_in_threadpool(who, request)
        except redis.RedisError as e:
            log.warning("key check: Redis: %s", e)
            return error_reply(503, "the key store (Redis) did not answer; try again", code="unavailable",
                               type_="server_error")
        if ident is None:
            # the key as sent is never echoed: it may be a real key in the wrong place, or long
            return error_reply(401, "Incorrect API key provided.", code="invalid_api_key")
        request.state.identity = ident
        response = _refused(request, ident, wait, lim)
        if response is None:
            response = await call_next(request)
        await _audit(r, request, ident, response.status_code)
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        request.state.audit_code = e.code or ""
        reply = error_reply(e.status, e.message, e.param, e.code, e.type)
        if e.headers:
            reply.headers.update(e.headers)
        return reply


async def _audit(r: redis.Redis, request: Request, ident: Identity, status: int) -> None:
    """Record the request when it is an audited one (conductor/api/audit.py ROUTES)."""
    action = audit.action_of(request.method, request.url.path)
    if action is None:
        return
    name, target = action
    target = target or getattr(request.state, "audit_target", "")
    try:
        await run_in_threadpool(audit.record, r, key_id=ident.key_id, tenant=ident.tenant, action=name,
                                route=f"{request.method} {request.url.path}", target=target, status=status,
                                code=getattr(request.state, "audit_code", ""))
    except redis.RedisError as e:  # the answer is given already; the log line stands for the record
        log.warning("audit record of %s %s: Redis: %s", name, target, e)


def _refused(request: Request, ident: Identity, wait: int, lim: tenant_limits.Limits) -> Response | None:
    """The gate's own refusals of a known key: over its tenant's rate (429, Retry-After), the status
    page without an admin key (403), an upload whose declared length is past the tenant's file limit
    (413 before its body is read; the upload counts its bytes too, for a body that says less)."""
    if wait:
        request.state.audit_code = "rate_limit_exceeded"
        reply = error_reply(429, f"Rate limit reached for tenant {ident.tenant}: its requests_per_minute; try "
                                 f"again in {wait} s", code="rate_limit_exceeded", type_="requests")
        reply.headers["Retry-After"] = str(wait)
        return reply
    if request.url.path == "/" and not ident.admin:
        return error_reply(403, "the status page shows every tenant's jobs: it needs an admin key", code="admin_only")
    declared = request.headers.get("content-length", "")
    if (lim.max_file_bytes and request.method == "POST" and request.url.path == "/v1/files" and declared.isdigit()
            and int(declared) > lim.max_file_bytes + MULTIPART_SLACK):
        request.state.audit_code = "file_too_large"
        return error_reply(413, f"File too large: at most {lim.max_file_bytes} bytes for this tenant (its "
                                "max_file_bytes)", "file", code="file_too_large")
    return None
