"""The embedded redis-server's ports: one that free_port() found free and something else took before
redis-server bound it (a test process's outgoing connection can get it from the same range) makes the
first start try new ports, not fail the test that asked for a server."""

from __future__ import annotations

import socket

import pytest
import redis

from conductor.embedded import EmbeddedRedis, free_port
from conductor.errors import RedisUnavailable


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


@pytest.mark.parametrize(("which", "cluster"), [("port", False), ("bus_port", True)])
def test_a_port_taken_before_the_first_start_is_replaced(which, cluster):
    srv = EmbeddedRedis(cluster=cluster)
    taken = getattr(srv, which)
    holder = _hold(taken)
    try:
        srv.start()
        try:
            assert getattr(srv, which) != taken
            assert redis.Redis(port=srv.port).ping()
        finally:
            srv.close()
    finally:
        holder.close()


def test_a_port_the_caller_chose_is_not_replaced():
    port = free_port()
    holder = _hold(port)
    try:
        with pytest.raises(RedisUnavailable, match="Address already in use"):
            EmbeddedRedis(port=port).start()
    finally:
        holder.close()


def test_a_cluster_whose_start_fails_leaves_no_node_running():
    from conductor.embedded import EmbeddedCluster
    cl = EmbeddedCluster(nodes=2)
    cl.nodes[1]._ports_chosen = False  # its port, taken below, is then the caller's: no retry
    holder = _hold(cl.nodes[1].port)
    try:
        with pytest.raises(RedisUnavailable):
            cl.start()
    finally:
        holder.close()
    assert cl.nodes[0].proc is not None and cl.nodes[0].proc.poll() is not None  # started, then stopped
