"""A worker's name: the host plus the systemd instance when run from a template unit, else a free
name of the host's (host, host-2, host-3, ...; lua/take_name.lua takes it atomically).

A stable name (an explicit --name, or host plus instance) survives restarts, so a restarted worker
keeps its Prometheus series and its consumer name, and takes back at once what its previous run
left pending. Without one, any number of workers start on one host, each under a name no live
worker holds.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from conductor.redis_contract.rules import NAME_CHARS

_UNIT = re.compile(r"/([^/@]+)@([^/]+)\.service$")
# key names and hash tags take only these characters (conductor/redis_contract/rules.py)
_BAD = re.compile(f"[^{NAME_CHARS}]")
STEM_MAX = 120  # room for "-10000" within keys.py's 128 characters


def systemd_instance(env: Mapping[str, str] = os.environ, cgroup: str = "/proc/self/cgroup") -> str | None:
    """The instance of the template unit running this process (``conductor-worker@3.service``: 3).

    CONDUCTOR_INSTANCE names it outright; otherwise, under systemd (which sets INVOCATION_ID for
    every service it starts), the unit is the last part of the process's cgroup path."""
    if env.get("CONDUCTOR_INSTANCE"):
        return env["CONDUCTOR_INSTANCE"]
    if not env.get("INVOCATION_ID"):
        return None
    try:
        with open(cgroup, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        m = _UNIT.search(line.strip())
        if m:
            return m.group(2)
    return None


def host_name() -> str:
    """This host's short name as a name stem: the characters keys.py takes, at most STEM_MAX."""
    return _BAD.sub("_", socket.gethostname().split(".")[0] or "worker")[:STEM_MAX]


def default_worker_name(env: Mapping[str, str] = os.environ, cgroup: str = "/proc/self/cgroup") -> str:
    host = socket.gethostname().split(".")[0] or "worker"
    inst = systemd_instance(env, cgroup)
    # key names and hash tags take only these characters (conductor/redis_contract/keys.py)
    name = f"{host}-{inst}" if inst else host
    return _BAD.sub("_", name)[:128]


def stable_worker_name(env: Mapping[str, str] = os.environ, cgroup: str = "/proc/self/cgroup") -> str | None:
    """The name a worker without --name keeps across restarts: host plus systemd instance; None
    outside a template unit (the worker then takes a free name of the host's at start)."""
    return default_worker_name(env, cgroup) if systemd_instance(env, cgroup) else None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner() -> dict[str, Any]:
    """Who runs this process, as its registration shows it: a restart on this host can then tell
    that the process which held its name is gone (``owner_gone``) without waiting out its heartbeat."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace()}


def owner_gone(shown: Mapping[str, Any]) -> bool:
    """True when a registration names a process of this host and pid namespace that no longer runs
    (or is a zombie). False whenever that cannot be told (another host or container, no /proc,
    the pid running again, reused by another process): the caller then waits out the heartbeat."""
    pid = shown.get("pid")
    if not isinstance(pid, int) or pid <= 0 or shown.get("host") != socket.gethostname():
        return False
    ns = _pid_namespace()
    if not ns or shown.get("pidns") != ns:
        return False
    if pid == os.getpid():
        return True  # the pid is ours now: the process that registered under it has ended
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]
