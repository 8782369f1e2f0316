"""``conductor serve``: OpenAI's Files and Batches API at ``/v1`` and a status page at ``/``.

Stateless: batches are jobs (their lifecycle in ``cdr:job:J:meta``, conductor/jobs/job_state.py),
file objects live in Redis and file bytes in a shared store directory
(conductor/api/upload_store.py), so any number of replicas may serve behind one load balancer.
This module puts the app together: the gate (keys, tenants' rate limits, the audit trail:
conductor/api/gate.py), the error replies, the expiry loop, the intake
resumer (a batch whose replica died mid-intake goes on from its cursor here), the finalizer (a
batch's output and error files written, then completed: conductor/api/finalize.py) and the routers
(conductor/api/files.py, conductor/api/batches.py, conductor/api/status_page.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from conductor.api import finalize, gate
from conductor.api.batch_retry import retry_router
from conductor.api.batches import batches_router
from conductor.api.errors import error_reply
from conductor.api.files import files_router
from conductor.api.status_page import status_router
from conductor.api.upload_store import FileStore
from conductor.client import Conductor
from conductor.errors import ConductorError
from conductor.intake import intake_resume
from conductor.jobs.job_state import expire_due_leased
from conductor.jobs.tenant_keys import KeyBook
from conductor.tier.object_store import Store

log = logging.getLogger(__name__)
EXPIRY_EVERY_S = 5.0


def make_app(redis_url: str, *, data_dir: str | None = None, api_keys: list[str] | None = None,
             segment_store: Store | None = None) -> FastAPI:
    """``segment_store``: the disk tier's (conductor/tier/): a batch's items beyond a model's
    resident_tokens go to it, and its output file reads the results moved there."""
    intake_resume.unreadable_s()  # a bad CONDUCTOR_INTAKE_UNREADABLE_S is refused before serving
    c = Conductor.from_url(redis_url, store=segment_store)
    store = FileStore(c.r, data_dir)
    # the keys in Redis (conductor keys create) and the --api-key ones: conductor/jobs/tenant_keys.py
    book = KeyBook(c.r, [k for k in (api_keys or []) if k])
    stop = threading.Event()
    owner = f"serve:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

    def expiry_loop() -> None:
        while not stop.wait(EXPIRY_EVERY_S):
            try:
                expire_due_leased(c, owner)
            except Exception as e:  # noqa: BLE001 - a Redis hiccup must not end the loop
                log.warning("expiry sweep: %s", e)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        t = threading.Thread(target=expiry_loop, name="expiry", daemon=True)
        t.start()
        # intake tasks whose replica died (conductor/intake/intake_resume.py): resumed from their cursor
        resume = threading.Thread(target=intake_resume.loop, args=(c, owner, stop), name="intake-resume", daemon=True)
        resume.start()
        # batches whose lines are all answered: finalizing, their files written, completed (conductor/api/finalize.py)
        fin = threading.Thread(target=finalize.loop, args=(c, store, owner, stop), name="finalize", daemon=True)
        fin.start()
        yield
        stop.set()
        t.join(5)  # joined, not left to die with the interpreter
        resume.join(5)
        fin.join(5)

    app = FastAPI(title="conductor", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store = store
    app.state.keys = book
    gate.install(app, c.r, book)  # keys, rate limits, the audit trail (conductor/api/gate.py)

    @app.exception_handler(ConductorError)
    async def conductor_error(_request: Request, e: ConductorError) -> JSONResponse:
        return error_reply(400, str(e), getattr(e, "field", None))

    app.include_router(files_router(c, store))
    app.include_router(batches_router(c, store, owner))
    app.include_router(retry_router(c, store, owner))
    app.include_router(status_router(c))
    return app
