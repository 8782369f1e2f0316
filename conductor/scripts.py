"""Loads the Lua scripts in lua/, inlining ``--@include`` lines, as redis-py Script objects.

redis-py's Script runs EVALSHA and reloads the script on NOSCRIPT (a restart or SCRIPT FLUSH
empties the cache), also inside pipelines.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

import redis

_INCLUDE = re.compile(r"^--@include\s+(\S+)\s*$", re.M)
# Every script of lua/ that is run (lib*.lua are includes); tests/test_scripts.py holds the two to each other.
NAMES = ("submit", "claim", "complete", "reclaim", "fail", "repair", "reindex", "seal", "ensure_model", "register",
         "heartbeat", "declare", "dead_retry", "repair_items", "trim", "trim_results", "lease",
         "register_segment", "fail_stored", "offload_results")


@functools.cache
def source(name: str) -> str:
    root = resources.files("conductor.lua")
    text = (root / f"{name}.lua").read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda m: (root / m.group(1)).read_text(encoding="utf-8"), text)


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
    register_segment: redis.commands.core.Script
    fail_stored: redis.commands.core.Script
    offload_results: redis.commands.core.Script
