"""Resuming intake tasks whose process died (conductor/intake/intake_task.py).

A resumer looks at the open tasks (``cdr:intake:tasks``) every ``every_s`` seconds; one whose lease
ran out and whose input file this host can read is taken (lua/intake_lease.lua: one taker) and run
from its cursor in a thread (conductor/intake/intake_run.py). Two kinds of process run one:

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
from conductor.intake.intake_run import run
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str

log = logging.getLogger(__name__)
RESUME_EVERY_S = 1.0
MAX_RUNNING = 4  # tasks one process runs at once (each reads a file and holds a connection)


class Resumer:
    def __init__(self, c: Conductor, owner: str) -> None:
        self.c, self.owner = c, owner
        self._running: dict[str, threading.Thread] = {}

    def tick(self) -> list[str]:
        """Take and start the tasks due; returns the jobs started."""
        self._running = {j: t for j, t in self._running.items() if t.is_alive()}
        jobs = [as_str(j) for j in self.c.r.zrange(K.INTAKE_TASKS_KEY, 0, 99)]
        if not jobs:
            return []
        now = T.server_ms(self.c.r)
        pipe = self.c.r.pipeline(transaction=False)
        for job in jobs:
            pipe.hmget(K.intake_task_key(job), "state", "lease_ms", "path")
        started = []
        for job, (state, lease_ms, path) in zip(jobs, pipe.execute(), strict=True):
            st = as_str(state, absent="")
            if st not in T.OPEN:
                self.c.r.zrem(K.INTAKE_TASKS_KEY, job)  # ended (or gone): off the index
                continue
            if job in self._running or len(self._running) >= MAX_RUNNING or int(lease_ms or 0) > now:
                continue
            if not os.access(as_str(path, absent=""), os.R_OK):
                continue  # another host's file: its resumers there
            if not calls.intake_lease(K.intake_task_key(job), self.owner, T.LEASE_MS).run(self.c.scripts).held:
                continue
            log.warning("resuming the intake of job %s (its last holder's lease lapsed)", job)
            t = threading.Thread(target=self._run, args=(job,), name=f"resume-{job}", daemon=True)
            self._running[job] = t
            t.start()
            started.append(job)
        return started

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
