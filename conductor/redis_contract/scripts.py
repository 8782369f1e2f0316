"""Loads the Lua scripts in lua/, inlining ``--@include`` lines, as redis-py Script objects.

An include may include others (``lib_lanes.lua`` includes ``lib.lua``): each file is inlined
once per script, where it is first named, and a cycle is an error. ``lib_generated.lua`` is not
a file: it is written here from conductor/redis_contract/config.py (the per-model config names and defaults)
and conductor/redis_contract/keys.py (the consumer group's name), so the Lua copies of those rules cannot drift.

redis-py's Script runs EVALSHA and reloads the script on NOSCRIPT (a restart or SCRIPT FLUSH
empties the cache), also inside pipelines.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from importlib import resources
from typing import Protocol

import redis

from conductor.redis_contract import config, keys

_INCLUDE = re.compile(r"^--@include\s+(\S+)\s*$", re.M)
GENERATED = "lib_generated.lua"
# Every script of lua/ that is run (lib*.lua are includes); tests/test_scripts.py holds the two to each other.
NAMES = ("submit", "claim", "complete", "reclaim", "fail", "repair", "reindex", "seal", "ensure_model", "register",
         "heartbeat", "declare", "dead_retry", "repair_items", "trim", "trim_results", "lease",
         "cancel", "register_segment", "fail_stored", "offload_results", "take_name", "job_class",
         "intake_create", "intake_lease", "intake_cursor", "compact_ids", "batch_finalize",
         "schema_init", "tenant_admit")


def _lua_value(v: object) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError(f"config default {v!r}: only numbers and strings have a Lua form here")
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(v)


def generated() -> str:
    """The text of lib_generated.lua, from the Python homes of the rules it carries."""
    names = ", ".join(_lua_value(n) for n in config.FIELDS)
    defaults = ", ".join(f"{n} = {_lua_value(v)}" for n, v in config.DEFAULTS.items())
    return (
        "-- lib_generated.lua: written by conductor/redis_contract/scripts.py when a script is loaded, never\n"
        "-- edited: CFG_NAMES and CFG_DEFAULTS from conductor/redis_contract/config.py FIELDS, GROUP from\n"
        "-- conductor/redis_contract/keys.py.\n"
        f"local CFG_NAMES = {{{names}}}\n"
        f"local CFG_DEFAULTS = {{{defaults}}}\n"
        "-- The batches stream's consumer group, which holds the in-flight batches.\n"
        f"local GROUP = {_lua_value(keys.GROUP)}\n"
    )


def expand(name: str, read: Callable[[str], str]) -> str:
    """``name``'s text with every include inlined, depth first, each file once (the first time it
    is named; later ``--@include`` lines of it become empty). ``read`` gives a file's text.
    Raises ValueError on a cycle (a file that includes itself, directly or not)."""
    done: set[str] = set()

    def inline(file: str, stack: tuple[str, ...]) -> str:
        if file in stack:
            raise ValueError(f"lua include cycle: {' -> '.join((*stack, file))}")
        done.add(file)
        text = read(file)

        def sub(m: re.Match[str]) -> str:
            inc = m.group(1)
            if inc in stack or inc == file:
                raise ValueError(f"lua include cycle: {' -> '.join((*stack, file, inc))}")
            if inc in done:
                return ""
            return inline(inc, (*stack, file)).rstrip("\n")

        return _INCLUDE.sub(sub, text)

    return inline(name, ())


def _read(file: str) -> str:
    if file == GENERATED:
        return generated()
    return (resources.files("conductor.lua") / file).read_text(encoding="utf-8")


@functools.cache
def source(name: str) -> str:
    return expand(f"{name}.lua", _read)


class Scripts:
    """The conductor's atomic operations, registered on one client."""

    def __init__(self, client: redis.Redis) -> None:
        for name in NAMES:
            setattr(self, name, client.register_script(source(name)))

    submit: redis.commands.core.Script
    claim: redis.commands.core.Script
    complete: redis.commands.core.Script
    reclaim: redis.commands.core.Script
    fail: redis.commands.core.Script
    reindex: redis.commands.core.Script
    seal: redis.commands.core.Script
    repair: redis.commands.core.Script
    ensure_model: redis.commands.core.Script
    register: redis.commands.core.Script
    heartbeat: redis.commands.core.Script
    declare: redis.commands.core.Script
    dead_retry: redis.commands.core.Script
    repair_items: redis.commands.core.Script
    trim: redis.commands.core.Script
    trim_results: redis.commands.core.Script
    lease: redis.commands.core.Script
    cancel: redis.commands.core.Script
    register_segment: redis.commands.core.Script
    fail_stored: redis.commands.core.Script
    offload_results: redis.commands.core.Script
    compact_ids: redis.commands.core.Script
    take_name: redis.commands.core.Script
    job_class: redis.commands.core.Script
    intake_create: redis.commands.core.Script
    intake_lease: redis.commands.core.Script
    intake_cursor: redis.commands.core.Script
    batch_finalize: redis.commands.core.Script
    schema_init: redis.commands.core.Script
    tenant_admit: redis.commands.core.Script


class ScriptClient(Protocol):
    """What a module that runs scripts needs of a client: its Redis and its registered scripts.
    A ``Conductor`` is one; the disk tier, job operations and verify take this instead of the
    client, so that none of them imports the client that uses them."""

    @property
    def r(self) -> redis.Redis: ...

    @property
    def scripts(self) -> Scripts: ...
