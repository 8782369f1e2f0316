"""A job's intake as a task recorded in Redis, so that it outlives the process running it.

``conductor submit`` and a Batch API batch (conductor/api/batches.py) used to be submitted by the
process that took the command or the request: killed mid-file, it left a job with part of its
lines and nobody to send the rest. Now the intake is a hash per job (``cdr:job:J:intake``,
keys.py; readable with ``redis-cli hgetall``) holding what a resumer needs to go on:

- the input: the source (``api``, ``cli``), the file's absolute path (the API's store file or the
  CLI's argument), its size and mtime (a changed file is not resumed), the API's file id and
  endpoint, the CLI's ``--skip-invalid``, the job's class;
- the model defaults the lines were checked with (``default_max_tokens`` per model, JSON): a
  resumed intake builds the same items, so a re-sent line has the same content sum;
- the cursor: ``line`` (the last input line of the last chunk Redis acknowledged) and ``sent``;
- an owner lease (``owner``, ``lease_ms``, the server's clock) and the ``state``: ``checking``
  (the file is being validated and declared), ``sending``, then ``done``, ``stopped`` (the job was
  cancelled or expired meanwhile: ``reason``, and ``line`` says where) or ``failed`` (``error``).

The task is born leased to its creator (lua/intake_create.lua, one step). The runner
(conductor/intake/intake_run.py) holds the lease while it works: a ``Keeper`` thread
renews it, and each chunk's cursor write (lua/intake_cursor.lua, one call per chunk) renews it
too. A resumer (conductor/intake/intake_resume.py) takes a task whose lease ran out
(lua/intake_lease.lua) and runs it from its cursor. Re-sending the chunk that was in flight when
the process died is harmless: submit.lua answers an id the job has with the same content as a
duplicate (tests/test_durable_intake.py checks it).

The open tasks are indexed in ``cdr:intake:tasks`` (job -> created ms); a task leaves it when it
ends. The index and the task are two keys (different cluster slots), so the index is only a list
of candidates: the task hash is the truth.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from conductor.errors import ConductorError
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import JobClass
from conductor.redis_contract.scripts import ScriptClient

LEASE_MS = 5_000  # a task whose holder died is taken over this long after its last renewal
RENEW_S = 1.5  # the keeper renews this often (a few renewals per lease)
OPEN = ("checking", "sending")
ENDED = ("done", "stopped", "failed")

# Test hooks (tests/test_durable_intake.py): the intake stops at a named point (pause_point), and a
# smaller chunk than SEND_CHUNK. Points: the file checked (before the declaration); declared, before
# the first chunk; the first chunk acknowledged but its cursor not yet written; before the second
# chunk; after the last chunk; sealed, before the batch's status moves.
PAUSE_ENV = "CONDUCTOR_TEST_PAUSE_AT"
CHUNK_ENV = "CONDUCTOR_TEST_SEND_CHUNK"
# (conductor/api/finalize.py adds one after the intake: output_write, a batch's files half written.)
POINTS = ("checked", "first_chunk", "unrecorded_chunk", "mid_file", "last_chunk", "state_change", "output_write")


@dataclass
class Task:
    """One job's intake task as recorded."""

    job: str
    source: str  # api or cli
    path: str
    state: str = "checking"
    line: int = 0
    sent: int = 0
    file_id: str = ""
    endpoint: str = ""
    skip_invalid: bool = False
    job_class: JobClass | None = None
    defaults: dict[str, int] | None = None  # model -> default_max_tokens the lines were checked with
    size: int | None = None
    mtime_ns: int | None = None
    owner: str = ""
    lease_ms: int = 0
    reason: str = ""
    error: str = ""

    def fields(self) -> dict[str, str]:
        out = {"job": self.job, "source": self.source, "path": self.path, "state": self.state,
               "line": str(self.line), "sent": str(self.sent), "created_ms": str(int(time.time() * 1000))}
        if self.file_id:
            out["file_id"] = self.file_id
        if self.endpoint:
            out["endpoint"] = self.endpoint
        if self.skip_invalid:
            out["skip_invalid"] = "1"
        if self.job_class is not None:
            jc = self.job_class
            out["job_class"] = msgspec.json.encode([jc.tenant, jc.priority, jc.deadline_ms]).decode()
        if self.defaults is not None:
            out["defaults"] = msgspec.json.encode(self.defaults).decode()
        if self.size is not None:
            out["size"], out["mtime_ns"] = str(self.size), str(self.mtime_ns)
        return out


def read(r: redis.Redis, job: str) -> Task | None:
    raw = {as_str(k): as_str(v) for k, v in r.hgetall(K.intake_task_key(job)).items()}
    if not raw:
        return None
    jc = msgspec.json.decode(raw["job_class"]) if raw.get("job_class") else None
    return Task(job=job, source=raw.get("source", "cli"), path=raw.get("path", ""), state=raw.get("state", ""),
                line=int(raw.get("line") or 0), sent=int(raw.get("sent") or 0), file_id=raw.get("file_id", ""),
                endpoint=raw.get("endpoint", ""), skip_invalid=raw.get("skip_invalid") == "1",
                job_class=JobClass(jc[0], jc[1], int(jc[2])) if jc else None,
                defaults=msgspec.json.decode(raw["defaults"]) if raw.get("defaults") else None,
                size=int(raw["size"]) if raw.get("size") else None,
                mtime_ns=int(raw["mtime_ns"]) if raw.get("mtime_ns") else None,
                owner=raw.get("owner", ""), lease_ms=int(raw.get("lease_ms") or 0),
                reason=raw.get("reason", ""), error=raw.get("error", ""))


def server_ms(r: redis.Redis) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def create(c: ScriptClient, task: Task, owner: str) -> None:
    """Record a new intake task for ``task.job``, born leased to ``owner`` (one script: a resumer
    never sees it open and unleased). A job whose earlier intake ended (a second ``conductor submit``
    into it) gets a fresh task; one whose intake another live process holds is refused."""
    key = K.intake_task_key(task.job)
    holder = calls.intake_create(key, owner, LEASE_MS, task.fields()).run(c.scripts)
    if holder:
        raise ConductorError(f"job {task.job!r} is being submitted by another process ({holder}); "
                             f"its intake resumes by itself if that process dies")
    # The index is another key (another cluster slot): a list of candidates written after the task,
    # which its lease keeps from any resumer meanwhile.
    c.r.zadd(K.INTAKE_TASKS_KEY, {task.job: int(time.time() * 1000)})


def cli_owner() -> str:
    """A process's name as a task owner (the serve replicas name themselves in conductor/api/app.py)."""
    return f"cli:{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def file_identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


class Lost(Exception):
    """The task's lease went to another process (this one stalled past it): stop without writing."""


class Keeper:
    """Renews the task's lease every RENEW_S while its runner works (a whole-file validation pass
    takes longer than a lease); ``lost`` is set when another process holds it now."""

    def __init__(self, c: ScriptClient, job: str, owner: str) -> None:
        self.c, self.key, self.owner = c, K.intake_task_key(job), owner
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"intake-lease-{job}", daemon=True)

    def __enter__(self) -> Keeper:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                got = calls.intake_lease(self.key, self.owner, LEASE_MS).run(self.c.scripts)
            except (redis.RedisError, ConductorError):
                continue  # a hiccup: the next renewal, or the lease lapses and a resumer goes on
            if not got.held:
                self.lost.set()
                return

    def cursor(self, line: int, sent: int, state: str = "", **fields: str) -> None:
        """Record progress (and renew the lease); raise Lost when the task is not ours any more."""
        if not calls.intake_cursor(self.key, self.owner, LEASE_MS, line, sent, state, **fields).run(self.c.scripts):
            self.lost.set()
            raise Lost(self.key)


_paused_jobs: dict[str, int] = {}  # job -> its place among this process's intakes (the test hook's order)
_paused_lock = threading.Lock()


def pause_point(r: redis.Redis, job: str, name: str) -> None:
    """Test-only: CONDUCTOR_TEST_PAUSE_AT=p1,p2,... makes the k-th intake this process runs stop at
    point pk (one of POINTS): it records the point in its task (field test_paused_at) and waits there
    to be killed."""
    raw = os.environ.get(PAUSE_ENV)
    if not raw:
        return
    points = raw.split(",")
    with _paused_lock:
        k = _paused_jobs.setdefault(job, len(_paused_jobs))
    if k >= len(points) or points[k] != name:
        return
    r.hset(K.intake_task_key(job), "test_paused_at", name)
    while True:
        time.sleep(3600)


def send_chunk_size(default: int) -> int:
    raw = os.environ.get(CHUNK_ENV)
    return int(raw) if raw and raw.isdigit() and int(raw) > 0 else default


def describe(task: Task) -> dict[str, Any]:
    """The task as ``conductor status`` and tests read it."""
    return {"state": task.state, "source": task.source, "line": task.line, "sent": task.sent,
            "owner": task.owner, "reason": task.reason, "error": task.error}
