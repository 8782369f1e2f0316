"""Processes an engine library started, ended with the worker however it ends (SIGKILL included).

vLLM's multiprocess mode runs its engine core and model workers in processes of their own, which
outlive a worker killed by SIGKILL (seen: both still running 25 s later, holding their memory). The
kernel gives a process no way to tie processes it did not start itself to its life, so a small
reaper process does: it blocks reading a pipe whose only writer is the worker, and when the pipe
closes (the worker ended, in any way) it SIGKILLs the processes it was given, each only if it is
still the same process (its start time, from /proc, unchanged: a pid can be reused).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_REAPER = """
import os, signal, sys
sys.stdin.buffer.read()
def start(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None
for arg in sys.argv[1:]:
    pid, when = arg.split(":")
    if start(int(pid)) == when:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
"""


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead and not yet waited for, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below ``pid`` (this one by default), from /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(children.get(root, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class Reaper:
    """Ends ``pids`` when this process ends; ``close`` ends them now (after a clean shutdown, those
    still alive)."""

    def __init__(self, pids: list[int]) -> None:
        args = [f"{p}:{t}" for p in pids if (t := start_time(p)) is not None]
        self.proc: subprocess.Popen[bytes] | None = None
        if args and sys.platform.startswith("linux"):
            self.proc = subprocess.Popen([sys.executable, "-c", _REAPER, *args], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def close(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)
