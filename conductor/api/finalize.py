"""A batch's last step (issue 25): ``finalizing`` while its output and error files are written,
then ``completed``, as OpenAI's lifecycle goes (validating -> in_progress -> finalizing -> completed).

A batch whose every line is answered reads ``finalizing`` (job_state.status_of: the batch's
``finalize`` mark, set at its creation) from the moment of its last answer. The finalizer, a loop
of every ``conductor serve`` replica (one at a time: the lease ``cdr:lease:finalize``), then looks
at the open batches (``cdr:batches:open``, keys.py) and for each one finalizing:

1. records ``finalizing`` with ``finalizing_at`` (lua/batch_finalize.lua 'start': the time of the
   last answer, the one every reader showed);
2. writes its output and error files into the store directory (``file-out-<batch>.jsonl``,
   ``file-err-<batch>.jsonl``: each under a temporary name first, then moved into place), the same
   lines conductor/api/batches.py ``result_lines`` gives;
3. records ``completed`` with the files' line counts (lua/batch_finalize.lua 'done').

A cancel or an expiry recorded meanwhile wins (the script refuses to complete a batch with an
``ending``): it ends ``cancelled`` or ``expired``, its files read from its results as for any
ended batch, so that output lines + error lines = input lines whichever comes first. A serve killed
in the middle leaves the batch ``finalizing``; the next finalizer (a restarted serve, another
replica once the lease lapses) writes the files again from the start. A completed batch's files
are the written ones (conductor/api/files.py); a batch completed before this step existed has none
and its files are read from its results, as before.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable

from conductor.api.batches import result_lines
from conductor.api.upload_store import ERROR_PREFIX, OUTPUT_PREFIX, FileStore
from conductor.client import Conductor
from conductor.intake.intake_task import pause_point
from conductor.jobs import job_state
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str

log = logging.getLogger(__name__)
FINALIZE_EVERY_S = 1.0
LEASE_MS = 30_000  # renewed between batches; a holder killed mid-file hands over when it lapses
LOOK_AT = 1000  # open batches looked at per tick, oldest first


def finalize_due(c: Conductor, store: FileStore, owner: str) -> list[str]:
    """Finalize every open batch whose lines are all answered, if ``owner`` holds the finalize lease;
    batches that ended otherwise leave the open index. Returns the batches completed."""
    done: list[str] = []
    for job in (as_str(j) for j in c.r.zrange(K.BATCHES_OPEN_KEY, 0, LOOK_AT - 1)):
        if not calls.lease(K.FINALIZE_LEASE_KEY, owner, LEASE_MS).run(c.scripts):
            break  # another replica finalizes now
        d = job_state.describe(c, job, advance=False)
        if d["status"] in job_state.TERMINAL:
            c.r.zrem(K.BATCHES_OPEN_KEY, job)
        elif d["status"] == "finalizing" and finalize(c, store, job, d):
            done.append(job)
    return done


def finalize(c: Conductor, store: FileStore, job: str, d: dict[str, object]) -> bool:
    """Steps 1-3 of the module's docstring for one batch; False when a cancel or an expiry came first."""
    at = int(d.get("finalizing_at") or time.time())  # type: ignore[call-overload]  # an int or None
    if not calls.batch_finalize(job, "start", at).run(c.scripts):
        return False
    n_out = _write(store, OUTPUT_PREFIX + job, result_lines(c, job, False, store), job=job, c=c)
    n_err = _write(store, ERROR_PREFIX + job, result_lines(c, job, True, store))
    if not calls.batch_finalize(job, "done", int(time.time()), output_lines=n_out, error_lines=n_err).run(c.scripts):
        log.info("batch %s ended otherwise while its files were written", job)
        return False
    c.r.zrem(K.BATCHES_OPEN_KEY, job)
    c.r.zrem(K.JOB_DEADLINES_KEY, job)  # completed: nothing left to expire
    log.info("batch %s completed: %d output lines, %d error lines", job, n_out, n_err)
    return True


def _write(store: FileStore, file_id: str, lines: Iterable[bytes], job: str = "", c: Conductor | None = None) -> int:
    """The lines into the store under a temporary name, then moved into place; how many. (The test
    hook CONDUCTOR_TEST_PAUSE_AT=output_write stops it with the output file written under its
    temporary name, not yet in place.)"""
    path = store.path(file_id)
    tmp = path.with_name(f".{file_id}.{secrets.token_hex(4)}.part")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for line in lines:
                f.write(line)
                n += 1
            f.flush()
            if c is not None:
                pause_point(c.r, job, "output_write")
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def loop(c: Conductor, store: FileStore, owner: str, stop: threading.Event,
         every_s: float = FINALIZE_EVERY_S) -> None:
    """serve's background loop: a tick every ``every_s`` until ``stop``."""
    while not stop.wait(every_s):
        try:
            finalize_due(c, store, owner)
        except Exception as e:  # noqa: BLE001 - a Redis hiccup or a full disk must not end the loop
            log.warning("batch finalizer: %s", e)
