"""Schema versions: which key layout a Redis holds, and the numbered moves between layouts.

Each migration is ``migrations/NNNN_name.py`` with ``VERSION`` (int) and ``up(client)``.
``migrate`` applies every migration above the stored version, in order; ``check`` refuses a
Redis whose version this code does not know (a newer layout, or one never migrated).

A fleet starts together (systemd at boot, ``docker compose up`` with replicas), so several
processes meet an empty or older Redis at the same moment (issue 37):

* An empty Redis gets the current version in one atomic step (``_EMPTY_LUA``): there is nothing to
  move, so no process can read a half-migrated version in between.
* Migrations run under a lease (``cdr:schema:lock``, SET NX PX, renewed while they run): one
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
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.keys import JOBS_KEY, MODELS_KEY, SCHEMA_KEY, SCHEMA_LOCK_KEY

log = logging.getLogger("conductor.schema")

LEASE_MS = 30_000  # a runner renews every third of it; a dead one frees it this long after
POLL_S = 0.1

# KEYS: schema, models, jobs. ARGV: the current version. The version is written only where there
# is none and the registries every writer fills first are empty: a Redis holding conductor keys
# without a version is not empty, and goes through the migrations (under the lease) as before.
# Returns the version Redis then holds, or 0 when it holds conductor keys and no version.
_EMPTY_LUA = """
local have = redis.call('GET', KEYS[1])
if have then return tonumber(have) end
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return tonumber(ARGV[1])
"""

# KEYS: the lease. ARGV: holder, lease ms. Renew only a lease this runner still holds.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


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
    _take_lease(client, holder, wait_bound_s() if wait_s is None else wait_s)
    lost = threading.Event()
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(client, holder, stop, lost), daemon=True,
                               name="schema-lease")
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
        client.register_script(_RELEASE_LUA)(keys=[SCHEMA_LOCK_KEY], args=[holder])


def _take_lease(client: redis.Redis, holder: str, wait_s: float) -> None:
    waited = _Waiter(client, wait_s, "to run the migrations")
    while not client.set(SCHEMA_LOCK_KEY, holder, nx=True, px=LEASE_MS):
        waited.tick()


def _renew(client: redis.Redis, holder: str, stop: threading.Event, lost: threading.Event) -> None:
    renew = client.register_script(_RENEW_LUA)
    while not stop.wait(LEASE_MS / 3000):
        try:
            if not renew(keys=[SCHEMA_LOCK_KEY], args=[holder, LEASE_MS]):
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
    if isinstance(client, redis.RedisCluster):
        # The three keys live in three slots, which one script may not touch on a cluster. The
        # read then SET NX is as safe here: every process writes conductor keys only after its own
        # check found a version, so with no version nothing but this path writes, and SET NX
        # lets one process write it.
        if client.exists(MODELS_KEY) or client.exists(JOBS_KEY):
            return current(client)
        client.set(SCHEMA_KEY, want, nx=True)
        return current(client)
    return int(client.register_script(_EMPTY_LUA)(keys=[SCHEMA_KEY, MODELS_KEY, JOBS_KEY], args=[want]))


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
