"""Loads the Lua scripts in lua/, inlining ``--@include`` lines, as redis-py Script objects.

An include may include others (``lib_lanes.lua`` includes ``lib.lua``): each file is inlined
once per script, where it is first named, and a cycle is an error. ``lib_generated.lua`` is not
a file: conductor/redis_contract/lua_generated.py writes it from the Python homes of the rules the
scripts share (config.py, keys.py, rules.py, records.Result), so the Lua copies of those rules cannot drift.

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

from conductor.redis_contract.lua_generated import generated

_INCLUDE = re.compile(r"^--@include\s+(\S+)\s*$", re.M)
GENERATED = "lib_generated.lua"
# Every script of lua/ that is run (lib*.lua are includes); tests/test_scripts.py holds the two to each other.
NAMES = ("submit", "claim", "complete", "reclaim", "fail", "repair", "reindex", "seal", "ensure_model", "register",
         "heartbeat", "idle_beat", "declare", "dead_retry", "repair_items_batch", "repair_items_lane",
         "repair_items_done",
         "trim", "trim_results", "lease", "cancel_registry", "cancel_lane", "cancel_segment",
         "register_segment", "fail_stored", "offload_results",
         "take_name", "job_class", "intake_create", "intake_lease", "intake_cursor", "compact_ids", "batch_finalize",
         "schema_init", "tenant_admit", "hand_over", "hand_in")


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
    idle_beat: redis.commands.core.Script
    declare: redis.commands.core.Script
    dead_retry: redis.commands.core.Script
    repair_items_batch: redis.commands.core.Script
    repair_items_lane: redis.commands.core.Script
    repair_items_done: redis.commands.core.Script
    trim: redis.commands.core.Script
    trim_results: redis.commands.core.Script
    lease: redis.commands.core.Script
    cancel_registry: redis.commands.core.Script
    cancel_lane: redis.commands.core.Script
    cancel_segment: redis.commands.core.Script
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
    hand_over: redis.commands.core.Script
    hand_in: redis.commands.core.Script


class ScriptClient(Protocol):
    """What a module that runs scripts needs of a client: its Redis and its registered scripts.
    A ``Conductor`` is one; the disk tier, job operations and verify take this instead of the
    client, so that none of them imports the client that uses them."""

    @property
    def r(self) -> redis.Redis: ...

    @property
    def scripts(self) -> Scripts: ...
