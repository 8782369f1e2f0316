"""``conductor exporter``: the broker's figures over HTTP for Prometheus, read from Redis on
every scrape (conductor/observability/broker_metrics.py), holding no state of its own."""

from __future__ import annotations

import signal
import threading

from prometheus_client import CollectorRegistry, start_http_server

from conductor.client import Conductor, connect
from conductor.observability.broker_metrics import ModelStateCollector
from conductor.redis_contract.schema import current


def registry(url: str, *, starving_s: float = 30.0, top_shapes: int = 10, jobs: int = 500) -> CollectorRegistry:
    """Only the broker's series: the worker series defined in conductor/observability/metrics.py live in the
    default registry, and an exporter serving them would publish zeros under no worker."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ModelStateCollector(lambda: _reader(url), starving_s=starving_s, top_shapes=top_shapes, jobs=jobs))
    return reg


def _reader(url: str) -> Conductor | None:
    """A Conductor that never migrates (an exporter only reads); None while Redis is empty, until
    a producer or worker has written the schema. One retry: while Redis is down a scrape must say
    redis_up 0 within Prometheus's scrape timeout (10 s by default), not after the 9 s backoff a
    worker rides a restart out with."""
    r = connect(url, timeout=3.0, retries=1)
    if current(r) == 0:
        r.close()
        return None
    return Conductor(r, migrate=False)


def serve(url: str, port: int, host: str = "0.0.0.0", **kw: float | int) -> int:
    """Serve until SIGTERM or SIGINT; a scrape that cannot read Redis says redis_up 0."""
    server, thread = start_http_server(port, host, registry=registry(url, **kw))  # type: ignore[arg-type]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"conductor exporter: serving http://{host}:{port}/metrics", flush=True)
    stop.wait()
    server.shutdown()
    thread.join(5)
    return 0
