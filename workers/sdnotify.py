"""The systemd notify protocol (sd_notify(3)) without libsystemd: one datagram per message.

Under ``Type=notify`` systemd passes NOTIFY_SOCKET, the address of an AF_UNIX datagram socket;
a name starting with '@' is in the abstract namespace (a leading NUL byte on the wire). The
worker sends READY=1 once it is registered and pulling, STOPPING=1 when it starts to drain,
STATUS=... lines a person reads in ``systemctl status``, and WATCHDOG=1 at half the interval
systemd gives in WATCHDOG_USEC (only when WATCHDOG_PID is unset or names this process). Outside
systemd (no NOTIFY_SOCKET) every call is a no-op that returns False.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("conductor.sdnotify")


def socket_address(path: str) -> str | bytes:
    """NOTIFY_SOCKET as an address for connect(): '@name' is the abstract name b'\\0name'."""
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when no watchdog is set."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    wpid = env.get("WATCHDOG_PID", "")
    if wpid and wpid.isdigit() and int(wpid) != (os.getpid() if pid is None else pid):
        return None  # the watchdog belongs to another process (a wrapper script, say)
    return int(usec) / 2 / 1_000_000


class Notifier:
    def __init__(self, path: str | None = None) -> None:
        self.path = os.environ.get("NOTIFY_SOCKET") if path is None else path
        self.watchdog_s = watchdog_interval()
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def send(self, *fields: str) -> bool:
        """One datagram of newline-separated KEY=VALUE fields; False when not sent."""
        if not self.path:
            return False
        msg = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(socket_address(self.path))
                s.sendall(msg)
            return True
        except OSError as e:
            if not self._warned:  # a missing socket must not take the worker down, nor flood the log
                log.warning("sd_notify to %s failed: %s", self.path, e)
                self._warned = True
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str = "") -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")
