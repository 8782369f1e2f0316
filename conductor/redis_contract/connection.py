"""Reaching Redis: the URL (cluster flag, redacted for messages), credentials and TLS probed once,
a client with bounded-backoff reconnects, and the pool of the server that holds a key."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from conductor.errors import RedisUnavailable


def connect(url: str, *, timeout: float = 10.0, retries: int = 8, blocking: bool = False) -> redis.Redis:
    """A client with bounded-backoff reconnects; raises RedisUnavailable with one clear line.

    ``retries``: 8 (0.05 s doubling to a 2 s cap, about 9 s in all) rides out a restart; a caller
    that must answer within a deadline of its own (a Prometheus scrape) asks for fewer.
    ``blocking``: no read timeout (``timeout`` still bounds the connect), for a client whose
    blocking reads (BLPOP) wait as long as their own timeout says.

    ``?cluster=1`` on the URL (any node of a Redis Cluster) gives a cluster client: every key of
    a model lives in one slot, so each script runs on the node that owns it.
    """
    shown = redact_url(url)
    url, cluster = _cluster_flag(url)
    read_timeout = None if blocking else timeout
    try:
        _refuse_bad_credentials_at_once(url, timeout)
        if cluster:
            cluster_client = _Cluster.from_url(
                url, socket_timeout=read_timeout, socket_connect_timeout=timeout,
                retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retries))
            cluster_client.ping()
            return cluster_client  # type: ignore[return-value]
        client: redis.Redis = redis.Redis.from_url(
            url,
            socket_timeout=read_timeout,
            socket_connect_timeout=timeout,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=retries),
            # CLUSTERDOWN: a cluster node refused the command before running it (a restart or a
            # failover in progress), so sending it again is safe.
            retry_on_error=[redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError],
            health_check_interval=30,
        )
        client.ping()
    except ValueError as e:
        raise RedisUnavailable(f"bad Redis URL {shown!r}: {e}") from None
    except redis.AuthenticationError as e:
        raise RedisUnavailable(f"Redis at {shown} refused the credentials: {e}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        raise RedisUnavailable(f"cannot reach Redis at {shown}: {e}") from None
    return client


def connect_async(url: str) -> Any:
    """An asyncio client (redis.asyncio) for blocking reads (no read timeout), a cluster client for a
    ``?cluster=1`` URL. Not probed: its caller reached the same URL with ``connect`` first. (Imported
    here: only the asyncio request client needs redis.asyncio.)"""
    import redis.asyncio as aioredis
    import redis.asyncio.cluster as aiocluster
    url, cluster = _cluster_flag(url)
    if cluster:
        return aiocluster.RedisCluster.from_url(
            url, socket_timeout=None, socket_connect_timeout=10)
    return aioredis.Redis.from_url(url, socket_timeout=None, socket_connect_timeout=10)


class _Cluster(redis.RedisCluster):
    """redis-py's cluster client, which also retries, with the same backoff as a dropped connection,
    a command that used up its redirections: "TTL exhausted", sixteen MOVED, ASK or TRYAGAIN
    replies in a row, each a refusal before the command ran. A slot being resharded answers a
    script TRYAGAIN for as long as its keys are half moved (the conductor's scripts that build key
    names declare the never-written key ``cdr:{model}`` among theirs, so that Redis refuses
    them then, rather than run them on a half-moved slot): seconds for a big slot, where
    redis-py's own retries last about 0.4 s (tests/test_shards_chaos.py)."""

    ERRORS_ALLOW_RETRY = (*redis.RedisCluster.ERRORS_ALLOW_RETRY, redis.exceptions.ClusterError)  # type: ignore[assignment]


def _cluster_flag(url: str) -> tuple[str, bool]:
    """The URL without its ``cluster`` query argument, and whether it asked for a cluster."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    flags = [v for k, v in query if k == "cluster"]
    if not flags:
        return url, False
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "cluster"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), flags[-1].lower() in ("1", "true", "yes")


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


# The first connection and its first reply: a Redis answers PING within milliseconds (a loading or
# busy one with an error at once), so silence this long is a port that is not Redis (a TLS port
# asked in plain text waits for a handshake that never comes), not a restart to ride out.
FIRST_REPLY_S = 5.0


def _refuse_bad_credentials_at_once(url: str, timeout: float) -> None:
    # redis-py's AuthenticationError is a ConnectionError, so the retrying client would spend
    # its whole backoff (tens of seconds) on a wrong password: ask once, without retries. A
    # timeout fails at once too: the retrying client would wait out every retry's timeout
    # (minutes) on a port that accepts and never answers (issue 37).
    first = min(timeout, FIRST_REPLY_S)
    probe = redis.Redis.from_url(url, socket_timeout=first, socket_connect_timeout=first,
                                 retry=Retry(NoBackoff(), 0))
    try:
        probe.ping()
    except redis.AuthenticationError:
        raise
    except redis.TimeoutError as e:
        connecting = "connect" in str(e).lower()
        raise RedisUnavailable(
            f"Redis at {redact_url(url)} did not answer within {first:g} s: " +
            ("no connection (a host that drops packets, or a wrong address?)" if connecting else
             "it accepted the connection and sent nothing (not a Redis port? a TLS port needs rediss://)")) from None
    except redis.exceptions.InvalidResponse as e:
        raise RedisUnavailable(f"{redact_url(url)} answered, but not as Redis does ({e}): is it the Redis port?") \
            from None
    except (redis.ConnectionError, OSError) as e:
        if "CERTIFICATE_VERIFY_FAILED" in str(e) or "WRONG_VERSION_NUMBER" in str(e):
            raise RedisUnavailable(f"TLS with Redis at {redact_url(url)} failed (check ssl_ca_certs, and "
                                   f"rediss:// against a TLS port): {e}") from None
        # down or restarting: the retrying client waits for it
    finally:
        probe.close()


def pool_for(r: redis.Redis, key: str) -> redis.ConnectionPool:
    """The connection pool of the server holding ``key``: the client's own, or on a Redis
    Cluster the pool of the node that owns the key's slot (a model's keys share one slot)."""
    if isinstance(r, redis.RedisCluster):
        node: Any = r.get_node_from_key(key)
        pool: redis.ConnectionPool = node.redis_connection.connection_pool
        return pool
    return r.connection_pool


# A stream entry as redis-py returns it on a client without decode_responses: (id, fields). redis-py's
# annotations say bytes | str for every reply; the conductor's clients always get bytes.
StreamEntry = tuple[bytes, dict[bytes, bytes]]


def as_str(v: Any, *, absent: str | None = None, errors: str = "strict") -> str:
    """A Redis reply value (bytes under decode_responses=False) as text: the one string helper.
    ``absent``: the text of a missing field or key (None), for a caller that compares it; else it
    reads "None". ``errors="replace"``: bytes that are not UTF-8 (an item id a producer wrote) show
    with U+FFFD instead of raising, for a listing that must show every entry."""
    if isinstance(v, bytes):
        return v.decode("utf-8", errors)
    if v is None and absent is not None:
        return absent
    return str(v)
