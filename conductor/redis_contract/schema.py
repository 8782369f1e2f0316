"""Schema versions: which key layout a Redis holds, and the numbered moves between layouts.

Each migration is ``migrations/NNNN_name.py`` with ``VERSION`` (int) and ``up(client)``.
``migrate`` applies every migration above the stored version, in order; ``check`` refuses a
Redis whose version this code does not know (a newer layout, or one never migrated).

A fleet starts together (systemd at boot, ``docker compose up`` with replicas), so several
processes meet an empty or older Redis at the same moment (issue 37):

* An empty Redis gets the current version in one atomic step (lua/schema_init.lua): there is
  nothing to move, so no process can read a half-migrated version in between.
* Migrations run under a lease (``cdr:schema:lock``, lua/lease.lua: SET NX PX, renewed while they run): one
  runner; every other process that needs the schema (a second ``conductor migrate``, a worker, a
  submit) waits for it, says so once, and gives up after ``CONDUCTOR_SCHEMA_WAIT_S`` seconds
  (default 300). A runner that dies leaves the lease to expire, and the next one takes over from
  the version it left (each step stores its version once done).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from importlib import resources
from types import ModuleType

import redis

from conductor.errors import SchemaMismatch
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.keys import JOBS_KEY, MODELS_KEY, SCHEMA_KEY, SCHEMA_LOCK_KEY
from conductor.redis_contract.scripts import Scripts

log = logging.getLogger("conductor.schema")

LEASE_MS = 30_000  # a runner renews every third of it; a dead one frees it this long after
POLL_S = 0.1


def migrations() -> list[ModuleType]:
    root = resources.files("conductor.migrations")
    names = sorted(p.name[:-3] for p in root.iterdir() if p.name[:4].isdigit() and p.name.endswith(".py"))
    mods = [importlib.import_module(f"conductor.migrations.{n}") for n in names]
    versions = [m.VERSION for m in mods]
    if versions != list(range(1, len(mods) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..N without gaps, found {versions}")
    return mods


def latest() -> int:
    return len(migrations())


def current(client: redis.Redis) -> int:
    raw = client.get(SCHEMA_KEY)
    return int(raw) if raw is not None else 0


def wait_bound_s() -> float:
    raw = os.environ.get("CONDUCTOR_SCHEMA_WAIT_S", "")
    try:
        return max(0.0, float(raw)) if raw else 300.0
    except ValueError:
        raise SchemaMismatch(f"CONDUCTOR_SCHEMA_WAIT_S={raw!r} is not a number of seconds") from None


def migrate(client: redis.Redis, *, wait_s: float | None = None) -> list[int]:
    """Apply pending migrations under the lease; returns the versions this call applied (none when
    another runner, waited for, did them)."""
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    scripts = Scripts(client)
    _take_lease(client, scripts, holder, wait_bound_s() if wait_s is None else wait_s)
    lost = threading.Event()
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(scripts, holder, stop, lost), daemon=True, name="schema-lease")
    renewer.start()
    try:
        applied = []
        have = current(client)  # read under the lease: a runner before this one may have moved it
        for mod in migrations():
            if mod.VERSION <= have:
                continue
            if lost.is_set():
                raise SchemaMismatch(f"the migration lease was lost after schema {current(client)} "
                                     "(Redis slow or restarted): run `conductor migrate` again")
            mod.up(client)
            client.set(SCHEMA_KEY, mod.VERSION)
            applied.append(mod.VERSION)
        return applied
    finally:
        stop.set()
        renewer.join()
        calls.lease(SCHEMA_LOCK_KEY, holder, 0).run(scripts)  # handed back: the next runner need not wait


def _take_lease(client: redis.Redis, scripts: Scripts, holder: str, wait_s: float) -> None:
    waited = _Waiter(client, wait_s, "to run the migrations")
    while not calls.lease(SCHEMA_LOCK_KEY, holder, LEASE_MS).run(scripts):
        waited.tick()


def _renew(scripts: Scripts, holder: str, stop: threading.Event, lost: threading.Event) -> None:
    while not stop.wait(LEASE_MS / 3000):
        try:
            if not calls.lease(SCHEMA_LOCK_KEY, holder, LEASE_MS).run(scripts):
                lost.set()
                return
        except redis.RedisError:
            continue  # the next renewal, a third of the lease later, tries again


class _Waiter:
    """Waiting for another process's migrations: one line when the wait starts, a refusal past the bound."""

    def __init__(self, client: redis.Redis, wait_s: float, what: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.wait_s, self.what, self.clock = client, wait_s, what, clock
        self.start: float | None = None

    def tick(self) -> None:
        holder = self.client.get(SCHEMA_LOCK_KEY)
        name = as_str(holder, errors="replace") if holder is not None else "a process that just finished"
        now = self.clock()
        if self.start is None:
            self.start = now
            log.warning(f"conductor: waiting for the schema migration that {name} runs "
                        f"(Redis at schema {current(self.client)}, this conductor needs {latest()}), "
                        f"at most {self.wait_s:g} s, {self.what}")
        elif now - self.start > self.wait_s:
            raise SchemaMismatch(f"the schema migration that {name} runs has not finished within {self.wait_s:g} s "
                                 f"(Redis at schema {current(self.client)}); wait for it, or set "
                                 "CONDUCTOR_SCHEMA_WAIT_S higher")
        time.sleep(POLL_S)


def _write_empty(client: redis.Redis, want: int) -> int:
    """The empty layout in one step; the version Redis then holds (0: conductor keys, no version)."""
    if not isinstance(client, redis.RedisCluster):
        try:
            return calls.schema_init(want).run(Scripts(client))
        except redis.ResponseError as e:
            if "slot" not in str(e):
                raise
    # A cluster node (through a cluster client or a plain one): the three keys live in three slots,
    # which one script may not touch. The read then SET NX is as safe here: every process writes
    # conductor keys only after its own check found a version, so with no version nothing but this
    # path writes, and SET NX lets one process write it.
    if client.exists(MODELS_KEY) or client.exists(JOBS_KEY):
        return current(client)
    client.set(SCHEMA_KEY, want, nx=True)
    return current(client)


def check(client: redis.Redis, *, auto: bool = True, wait_s: float | None = None) -> int:
    """Make sure Redis holds the layout this code speaks: an empty Redis is given it if ``auto``;
    a migration another process runs is waited for (bounded, said once on the log)."""
    want = latest()
    waiter: _Waiter | None = None
    while True:
        have = current(client)
        if have == want:
            return have
        if have > want:
            raise SchemaMismatch(f"Redis holds key schema {have}, this conductor knows up to {want}: upgrade it")
        if have == 0 and auto:
            have = _write_empty(client, want)
            if have == want:
                return have
            if have == 0:
                # conductor keys but no version (written before versions, or the key lost): the
                # migrations from the start, as this path always ran them; migrate() waits for a
                # runner already at it.
                migrate(client, wait_s=wait_s)
                continue
        if client.exists(SCHEMA_LOCK_KEY):
            waiter = waiter or _Waiter(client, wait_bound_s() if wait_s is None else wait_s, "then starting")
            waiter.tick()
            continue
        if current(client) != have:
            continue  # a runner finished between the two reads
        raise SchemaMismatch(f"Redis holds key schema {have}, this conductor needs {want}: run `conductor migrate`")
