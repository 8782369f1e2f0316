"""A worker's default name: the host, plus the systemd instance when run from a template unit.

Stable across restarts, so a restarted worker keeps its Prometheus series and its consumer
name (and takes back at once what its previous run left pending); two workers on one host
need distinct instances or an explicit --name.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

_UNIT = re.compile(r"/([^/@]+)@([^/]+)\.service$")


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


def default_worker_name(env: Mapping[str, str] = os.environ, cgroup: str = "/proc/self/cgroup") -> str:
    host = socket.gethostname().split(".")[0] or "worker"
    inst = systemd_instance(env, cgroup)
    # key names and hash tags take only these characters (conductor/redis_contract/keys.py)
    name = f"{host}-{inst}" if inst else host
    return re.sub(r"[^A-Za-z0-9._/@+=-]", "_", name)[:128]
