"""Resuming intake tasks whose process died (conductor/intake/intake_task.py).

A resumer looks at the open tasks (``cdr:intake:tasks``) every ``every_s`` seconds; one whose lease
ran out and whose input file this host can read is taken (lua/intake_lease.lua: one taker) and run
from its cursor in a thread (conductor/intake/intake_run.py). A task whose file this host cannot
read is left to the resumers of a host that can, which take it within seconds of its lease
lapsing; one whose lease has lapsed ``UNREADABLE_S`` (300 s; ``CONDUCTOR_INTAKE_UNREADABLE_S``)
with nobody taking it has no process able to read its file: the resumer that finds it so takes
its lease (one taker; a task another process took meanwhile is handed back, never failed) and
ends it ``failed``, its job failed with the error naming the path (intake_run.fail_unreadable).
A task whose holder is alive is never failed: its lease runs; nor is one that a resumer able to
read it is too busy to take (it stamps ``readable_ms`` on the task). Two kinds of process run one:

- every ``conductor serve`` replica (conductor/api/app.py): the API's tasks (the store directory
  is shared by the replicas) and CLI tasks whose path it can read;
- the maintenance lease holder of a model's workers (workers/maintenance.py): the tasks whose file
  it can read on its host (a CLI path there, or the API's store directory when it is shared with
  the workers), for a fleet that runs without serve.
"""

from __future__ import annotations

import logging
import os
import threading

from conductor.client import Conductor
from conductor.errors import ConductorError
from conductor.intake import intake_task as T
from conductor.intake.intake_run import fail_unreadable, run
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str

log = logging.getLogger(__name__)
RESUME_EVERY_S = 1.0
MAX_RUNNING = 4  # tasks one process runs at once (each reads a file and holds a connection)
UNREADABLE_S = 300.0  # a task's lease lapsed this long with its file unreadable here: nobody can read it
UNREADABLE_ENV = "CONDUCTOR_INTAKE_UNREADABLE_S"


def unreadable_s() -> float:
    """UNREADABLE_S, or the positive number of seconds CONDUCTOR_INTAKE_UNREADABLE_S gives."""
    raw = os.environ.get(UNREADABLE_ENV, "")
    if not raw:
        return UNREADABLE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConductorError(f"{UNREADABLE_ENV}: must be a positive number of seconds, got {raw!r}")
    return value


class Resumer:
    def __init__(self, c: Conductor, owner: str, unreadable_after_s: float | None = None) -> None:
        self.c, self.owner = c, owner
        self.unreadable_ms = int(1000 * (unreadable_s() if unreadable_after_s is None else unreadable_after_s))
        self._running: dict[str, threading.Thread] = {}
        # tasks in the index at the last tick (open, or ended and not yet taken off): while any is, an
        # idle lease holder keeps its sweep every second, so that a dead owner's task resumes on time
        self.open = 0

    def tick(self) -> list[str]:
        """Take and start the tasks due; returns the jobs started."""
        self._running = {j: t for j, t in self._running.items() if t.is_alive()}
        jobs = [as_str(j) for j in self.c.r.zrange(K.INTAKE_TASKS_KEY, 0, 99)]
        self.open = len(jobs)
        if not jobs:
            return []
        now = T.server_ms(self.c.r)
        pipe = self.c.r.pipeline(transaction=False)
        for job in jobs:
            pipe.hmget(K.intake_task_key(job), "state", "lease_ms", "path", "owner", "takes", "readable_ms")
        started = []
        for job, (state, lease_ms, path, holder, takes, readable_ms) in zip(jobs, pipe.execute(), strict=True):
            st = as_str(state, absent="")
            if st not in T.OPEN:
                self.c.r.zrem(K.INTAKE_TASKS_KEY, job)  # ended (or gone): off the index
                continue
            if job in self._running or int(lease_ms or 0) > now:
                continue
            if not os.access(as_str(path, absent=""), os.R_OK):
                # another host's file: its resumers there; unless none took it, nor could read it
                # while busy, for a long time
                lapsed = now - max(int(lease_ms or 0), int(readable_ms or 0))
                if lapsed >= self.unreadable_ms:
                    self._unreadable(job, as_str(path, absent=""), lapsed, as_str(holder, absent="") == self.owner,
                                     int(takes or 0))
                continue
            if len(self._running) >= MAX_RUNNING:
                # busy here, but the file is readable: no other host may take it for unreadable
                self.c.r.hset(K.intake_task_key(job), "readable_ms", now)
                continue
            if not calls.intake_lease(K.intake_task_key(job), self.owner, T.LEASE_MS).run(self.c.scripts).held:
                continue
            log.warning("resuming the intake of job %s (its last holder's lease lapsed)", job)
            t = threading.Thread(target=self._run, args=(job,), name=f"resume-{job}", daemon=True)
            self._running[job] = t
            t.start()
            started.append(job)
        return started

    def _unreadable(self, job: str, path: str, lapsed_ms: int, ours: bool, takes: int) -> None:
        """Fail the task of ``job``, whose file nobody read for ``lapsed_ms``: only with its lease
        taken here, and only when no other process took it since it was read (``takes``)."""
        key = K.intake_task_key(job)
        if not calls.intake_lease(key, self.owner, T.LEASE_MS).run(self.c.scripts).held:
            return  # another process holds it now: it is alive
        takes_now, readable_ms = self.c.r.hmget(key, "takes", "readable_ms")
        if int(takes_now or 0) != takes + (0 if ours else 1) or os.access(path, os.R_OK) or \
                T.server_ms(self.c.r) - int(readable_ms or 0) < self.unreadable_ms:
            calls.intake_lease(key, self.owner, 0).run(self.c.scripts)  # taken meanwhile, or readable again
            return
        fail_unreadable(self.c, job, self.owner, path, lapsed_ms / 1000)

    def _run(self, job: str) -> None:
        try:
            out = run(self.c, job, self.owner)
            log.warning("intake of job %s: %s", job, out.state)
        except ConductorError as e:
            log.warning("intake of job %s failed: %s", job, e)
        except Exception:  # noqa: BLE001 - a thread's end must be logged, the task resumes later
            log.exception("intake of job %s stopped", job)

    def join(self, timeout: float) -> None:
        for t in list(self._running.values()):
            t.join(timeout)


def loop(c: Conductor, owner: str, stop: threading.Event, every_s: float = RESUME_EVERY_S) -> None:
    """serve's background loop: a tick every ``every_s`` until ``stop``."""
    r = Resumer(c, owner)
    while not stop.wait(every_s):
        try:
            r.tick()
        except Exception as e:  # noqa: BLE001 - a Redis hiccup must not end the loop
            log.warning("intake resume sweep: %s", e)
