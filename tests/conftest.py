"""Fixtures: every test talks to a real redis-server started here, never to 127.0.0.1:6379."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.formats.lines import parse_line
from conductor.redis_contract.records import PreparedItem

ROOT = Path(__file__).resolve().parent.parent

# One OpenMP thread for every torch and vLLM the tests run, in this process or a child (which inherits
# it): before any test module loads torch. The suite keeps both cores of a 2-core machine busy with
# three test processes, and an engine's second thread spin-waits for a core another test holds: the
# torch and conformance modules took 40 to 51 s of CPU beside a load, 14 s with one thread. The tiny
# models gain nothing from a second thread; a caller's own setting stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# CONDUCTOR_TEST_CLUSTER=1 runs the suite on a one-node Redis Cluster that owns every slot, where
# Redis refuses any command or script touching two slots (tests/test_cluster_slots.py runs a
# part of it that way in every run).
CLUSTER = os.environ.get("CONDUCTOR_TEST_CLUSTER") == "1"

# The modules that take longest, longest first (a loaded full run's times, 2026-12-04): pytest-xdist
# hands out whole modules (--dist loadfile) in collection order (--no-loadscope-reorder), so these start
# at once and the run ends on short ones. Its own order, by the number of tests, started the one-test
# modules (test_chaos.py, test_answer_deaths.py, about 50 s each when loaded) last. The rest follow by
# their number of tests, most first, as pytest-xdist would have it.
LONGEST_FIRST = ["test_engines_vllm.py", "test_bench_smoke.py", "test_script_acl_atomicity.py",
                 "test_disk_tier.py", "test_shards.py", "test_engines_openai.py", "test_accounting_stateful.py",
                 "test_cli_newcomer.py", "test_answer_ledger.py", "test_durable_intake.py", "test_handoff.py",
                 "test_worker_outage.py", "test_tenant_keys.py", "test_idle_shards.py", "test_cli_basics.py",
                 "test_acl.py", "test_badinput.py", "test_cli_trust.py", "test_shards_chaos.py",
                 "test_engines_conformance.py", "test_chaos.py", "test_idle_rate.py", "test_engines_torch.py",
                 "test_exit_status.py", "test_cli.py", "test_memory_cap.py", "test_answer_deaths.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    count: dict[str, int] = {}
    for it in items:
        count[it.path.name] = count.get(it.path.name, 0) + 1
    # a stable sort: each module's tests keep their order
    items.sort(key=lambda it: (rank.get(it.path.name, len(rank)), -count[it.path.name], str(it.path)))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    srv = EmbeddedRedis(cluster=CLUSTER).start()
    if CLUSTER:
        assert connect(srv.url).info("cluster")["cluster_enabled"] == 1
    assert srv.port != 6379
    yield srv
    srv.close()


@pytest.fixture()
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    r = connect(redis_server.url)
    r.flushall()
    r.script_flush()
    yield redis_server.url
    r.close()


@pytest.fixture()
def cdr(redis_url: str) -> Iterator[Conductor]:
    """A Conductor on the test's Redis, closed after the test (a client left to the garbage collector
    warns in whichever later test collects it, and warnings are errors)."""
    c = Conductor(connect(redis_url))
    yield c
    c.r.close()


@pytest.fixture()
def fresh_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A private server a test may kill and restart (AOF with fsync always)."""
    (tmp_path / "redis").mkdir()  # redis-server refuses to start in a --dir that does not exist
    srv = EmbeddedRedis(appendonly=True, appendfsync="always", dir=str(tmp_path / "redis"), cluster=CLUSTER).start()
    yield srv
    srv.close()


def item(i: int | str, tokens: int, *, model: str = "m", prefix: tuple[str, ...] = ("sys",),
         max_tokens: int = 16, payload: object = None) -> PreparedItem:
    return parse_line(json.dumps({"id": str(i), "model": model, "prefix": list(prefix), "prompt": f"p{i}",
                                  "input_tokens": tokens, "max_tokens": max_tokens, "payload": payload}))


def cli(*args: str, url: str, check: bool = True, timeout: float = 120, env: dict | None = None,
        **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url, **(env or {}))
    p = subprocess.run([sys.executable, "-m", "conductor", *args], capture_output=True, env=env,
                       timeout=timeout, cwd=str(ROOT), **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"conductor {' '.join(args)} exited {p.returncode}: {p.stderr.decode()[-2000:]}")
    return p


def follow_with_workers(url: str, job: str, out: Path, workers: list[tuple[str, str]], *, batch_size: int,
                        batch_tokens: int, timeout: float = 240) -> list[dict]:
    """Start one `conductor worker` (sim engine) process per (model, name), follow the job's
    results to ``out`` until done, stop the workers (each must exit 0); the result rows."""
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    procs = [subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker",
                               "--engine", "sim", "--model", model, "--name", name, "--max-batch-size",
                               str(batch_size), "--max-batch-tokens", str(batch_tokens), "--max-input-len", "4096"],
                              env=env, cwd=str(ROOT))
             for model, name in workers]
    try:
        cli("results", job, "--follow", "-o", str(out), url=url, timeout=timeout)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            assert p.wait(30) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]
