"""Which Redis failures a worker rides out (keep the work, retry later) rather than dies of.

A connection that drops is the obvious case; a server that is up but refuses writes for a
while is the other one: no replica acknowledges (NOREPLICAS), a failover left it read-only
(READONLY), it is loading its data (LOADING), a script is hogging it (BUSY), it is out of
memory (OOM, which the client reports as QueueFull). A worker that died on these would throw
away finished sequences it could have written a second later.
"""

from __future__ import annotations

import redis

from conductor.errors import NotReplicated, Paused, QueueFull, RedisUnavailable

_TRANSIENT_REPLIES = ("NOREPLICAS", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN",
                      "OOM", "PAUSED")

# redis-py turns these replies into their own classes and strips the code from the message,
# so the text check below never sees them.
_TRANSIENT_CLASSES = (redis.ConnectionError, redis.TimeoutError, RedisUnavailable, QueueFull, Paused, NotReplicated,
                      OSError,
                      redis.exceptions.ReadOnlyError, redis.exceptions.TryAgainError,
                      redis.exceptions.ClusterDownError, redis.exceptions.MasterDownError,
                      redis.exceptions.MovedError, redis.exceptions.AskError,
                      redis.exceptions.OutOfMemoryError)

RIDE_OUT: tuple[type[BaseException], ...] = (redis.RedisError, RedisUnavailable, QueueFull, Paused, NotReplicated,
                                             OSError)


def is_transient(e: BaseException) -> bool:
    """True for failures that pass by themselves; False for bugs and bad arguments."""
    if isinstance(e, _TRANSIENT_CLASSES):
        return True
    if isinstance(e, redis.ResponseError):
        return str(e).startswith(_TRANSIENT_REPLIES)
    return False
