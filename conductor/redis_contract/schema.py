"""Schema versions: which key layout a Redis holds, and the numbered moves between layouts.

Each migration is ``migrations/NNNN_name.py`` with ``VERSION`` (int) and ``up(client)``.
``migrate`` applies every migration above the stored version, in order; ``check`` refuses a
Redis whose version this code does not know (a newer layout, or one never migrated).
"""

from __future__ import annotations

import importlib
from importlib import resources
from types import ModuleType

import redis

from conductor.errors import SchemaMismatch
from conductor.redis_contract.keys import SCHEMA_KEY


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


def migrate(client: redis.Redis) -> list[int]:
    """Apply pending migrations; returns the versions applied."""
    applied = []
    have = current(client)
    for mod in migrations():
        if mod.VERSION > have:
            mod.up(client)
            client.set(SCHEMA_KEY, mod.VERSION)
            applied.append(mod.VERSION)
    return applied


def check(client: redis.Redis, *, auto: bool = True) -> int:
    """Make sure Redis holds the layout this code speaks; an empty Redis is migrated if ``auto``."""
    have = current(client)
    want = latest()
    if have == want:
        return have
    if have == 0 and auto:
        migrate(client)
        return want
    if have > want:
        raise SchemaMismatch(f"Redis holds key schema {have}, this conductor knows up to {want}: upgrade it")
    raise SchemaMismatch(f"Redis holds key schema {have}, this conductor needs {want}: run `conductor migrate`")
