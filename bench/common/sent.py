"""Commands a client sends, counted on its own connections: what one worker costs Redis in round
trips, apart from the commands its scripts run inside Redis (which INFO commandstats counts too)
and without MONITOR (which slows the server it measures).

``install()`` (``uninstall()`` undoes it) wraps redis-py's ``send_packed_command`` (every command
a connection sends goes through it: plain calls, pipelines, and the claim's hiredis-packed pair)
and counts the RESP arrays in what it sends, per connection; ``of(client)`` sums the counts of a
client's connections.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import redis
from redis.connection import AbstractConnection

_lock = threading.Lock()
_counts: Counter[int] = Counter()  # id(connection) -> commands sent
_original: Any = None


def commands_in(packed: bytes) -> int:
    """How many RESP commands (arrays of bulk strings, as clients send them) ``packed`` holds."""
    n = pos = 0
    end = len(packed)
    while pos < end:
        if packed[pos:pos + 1] != b"*":
            raise ValueError(f"not a RESP array at byte {pos}")
        eol = packed.index(b"\r\n", pos)
        args = int(packed[pos + 1:eol])
        pos = eol + 2
        for _ in range(args):
            eol = packed.index(b"\r\n", pos)
            pos = eol + 2 + int(packed[pos + 1:eol]) + 2
        n += 1
    return n


def install() -> None:
    global _original
    if _original is not None:
        return
    original: Any = AbstractConnection.send_packed_command
    _original = original

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, (bytes, bytearray, memoryview)) else b"".join(command)
        with _lock:
            _counts[id(self)] += commands_in(bytes(data))
        # the method captured here, not the module's: a thread that entered this wrapper just before
        # uninstall() still sends its command (it raised TypeError on a None, in a full test run)
        original(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


def uninstall() -> None:
    global _original
    if _original is not None:
        AbstractConnection.send_packed_command = _original  # type: ignore[method-assign]
        _original = None


def reset() -> None:
    with _lock:
        _counts.clear()


def of(client: redis.Redis) -> int:
    """Commands sent since ``reset()`` on the connections of ``client``'s pool (a cluster client's:
    of each node's pool)."""
    if isinstance(client, redis.RedisCluster):
        pools = [n.redis_connection.connection_pool for n in client.get_nodes() if n.redis_connection is not None]
    else:
        pools = [client.connection_pool]
    # no public list of a pool's connections
    conns = [c for p in pools for c in [*p._available_connections, *p._in_use_connections]]  # noqa: SLF001
    with _lock:
        return sum(_counts[id(c)] for c in conns)


def rates(clients: dict[str, redis.Redis], seconds: float) -> dict[str, float]:
    """Commands a second each client sent over the next ``seconds`` (counting only for that window)."""
    install()
    try:
        reset()
        t0 = time.monotonic()
        time.sleep(seconds)
        took = time.monotonic() - t0
        return {name: of(c) / took for name, c in clients.items()}
    finally:
        uninstall()
