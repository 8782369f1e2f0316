"""A fleet started together comes up (issue 37): an empty Redis gets its layout in one step, and
migrations run under a lease with one runner while every other process waits for it, bounded and
saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conductor.client import connect
from conductor.errors import SchemaMismatch
from conductor.redis_contract import keys as K
from conductor.redis_contract import schema
from tests.conftest import ROOT, cli
from tests.helpers import wait_for

WORKERS = 8


@pytest.fixture()
def r(redis_url):
    client = connect(redis_url)
    yield client
    client.close()


def _start_fleet(url: str, src: Path, job: str, logs: Path) -> tuple[list[subprocess.Popen], subprocess.Popen]:
    """Eight workers and a submit, started together; each one's stderr in ``logs``/NAME.err."""
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    base = [sys.executable, "-m", "conductor", "--log-level", "warning"]
    logs.mkdir()

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        with open(logs / f"{name}.err", "wb") as err:
            return subprocess.Popen([*base, *argv], env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=err)
    workers = [start(f"w{i}", ["worker", "--engine", "sim", "--model", "m", "--create", "--name", f"w{i}",
                               "--max-batch-size", "8"]) for i in range(WORKERS)]
    submit = start("submit", ["submit", str(src), "--job", job, "--quiet", "--create"])
    return workers, submit


def _fleet_round(url: str, tmp_path: Path, n: int) -> None:
    r = connect(url)
    r.flushall()
    src = tmp_path / f"p{n}.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "model": "m", "prompt": f"p{i}", "input_tokens": 10,
                                       "max_tokens": 4}) + "\n" for i in range(40)))
    logs = tmp_path / f"logs{n}"
    workers, submit = _start_fleet(url, src, f"j{n}", logs)
    try:
        submit.wait(180)
        assert submit.returncode == 0, f"round {n}: submit exited {submit.returncode}: " + \
            (logs / "submit.err").read_text()
        # every worker is up and registered, none refused (the old failure: an exit with a schema message)
        wait_for(lambda: all(p.poll() is None for p in workers) and
                 len(r.keys(f"{K.ModelKeys('m').base}:hb:*")) == WORKERS
                 or any(p.poll() is not None for p in workers), "eight heartbeats or an exit", timeout=180)
        dead = [(i, p.returncode, (logs / f"w{i}.err").read_text()) for i, p in enumerate(workers)
                if p.poll() is not None]
        assert not dead, f"round {n}: workers exited: {dead}"
        cli("status", f"j{n}", "--watch", "--interval", "0.2", url=url, timeout=180)
    finally:
        for p in workers:
            p.terminate()
        for p in workers:
            p.wait(60)
    assert [p.returncode for p in workers] == [0] * WORKERS
    assert r.get(K.SCHEMA_KEY) == str(schema.latest()).encode()
    r.close()


def test_eight_workers_and_a_submit_started_together_on_an_empty_redis_all_come_up(redis_url, tmp_path):
    _fleet_round(redis_url, tmp_path, 0)  # twenty rounds: the slow form below


@pytest.mark.slow
def test_eight_workers_and_a_submit_twenty_times(redis_url, tmp_path):
    for n in range(20):
        _fleet_round(redis_url, tmp_path, n)


def test_concurrent_checks_on_an_empty_redis_never_see_a_partial_version(redis_url):
    # Sixteen clients check the schema of an empty Redis at the same moment, twenty times: each gets
    # the current version (the old step-by-step migration let a reader see 1..5 and refuse).
    clients = [connect(redis_url) for _ in range(16)]
    try:
        for _ in range(20):
            clients[0].flushall()
            got, errors = _check_together(clients)
            assert not errors and got == [schema.latest()] * len(clients)
    finally:
        for c in clients:
            c.close()


def _check_together(clients: list) -> tuple[list[int], list[BaseException]]:
    barrier = threading.Barrier(len(clients))
    errors: list[BaseException] = []
    got: list[int] = []

    def one(c):
        barrier.wait()
        try:
            got.append(schema.check(c))
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)
    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, errors


def test_conductor_keys_without_a_version_still_go_through_the_migrations(redis_url, r):
    r.sadd(K.MODELS_KEY, "m")  # not empty: the empty layout is not written over it
    assert schema.check(r) == schema.latest()
    wait_for(lambda: not r.exists(K.SCHEMA_LOCK_KEY), "the lease handed back")


def _slow_migrations(monkeypatch, calls: list[int], pause_s: float) -> None:
    """Migrations 1..latest whose last step takes ``pause_s``, counting the runs of each."""
    n = schema.latest()

    def up_for(v):
        def up(_client):
            calls.append(v)
            if v == n:
                time.sleep(pause_s)
        return up
    mods = [SimpleNamespace(VERSION=v, up=up_for(v)) for v in range(1, n + 1)]
    monkeypatch.setattr(schema, "migrations", lambda: mods)


def test_concurrent_migrations_have_one_runner_and_the_others_wait(redis_url, r, monkeypatch):
    r.set(K.SCHEMA_KEY, schema.latest() - 1)
    calls: list[int] = []
    _slow_migrations(monkeypatch, calls, 1.0)
    applied: list[list[int]] = []
    checked: list[int] = []
    errors: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)
    opened: list = []

    def client():
        opened.append(connect(redis_url))
        return opened[-1]
    threads = [threading.Thread(target=run, args=(lambda: applied.append(schema.migrate(client())),))
               for _ in range(4)]
    threads[0].start()
    wait_for(lambda: r.exists(K.SCHEMA_LOCK_KEY), "the first runner's lease")
    for t in threads[1:]:
        t.start()
    # a process that needs the schema meanwhile waits for the runner, then comes up
    waiter = threading.Thread(target=run, args=(lambda: checked.append(schema.check(client())),))
    waiter.start()
    for t in [*threads, waiter]:
        t.join(60)
    for c in opened:
        c.close()
    assert not errors
    assert calls == [schema.latest()]  # one runner ran the last step, once
    assert sorted(applied) == [[], [], [], [schema.latest()]]
    assert checked == [schema.latest()]
    wait_for(lambda: not r.exists(K.SCHEMA_LOCK_KEY), "the lease handed back")


def test_a_worker_waits_for_a_running_migration_says_so_and_comes_up(redis_url, r, tmp_path):
    r.set(K.SCHEMA_KEY, schema.latest() - 1)
    r.set(K.SCHEMA_LOCK_KEY, "host-a:123:abc", px=60_000)  # a migration in progress elsewhere
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url)
    err = tmp_path / "w.err"
    with open(err, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "conductor", "worker", "--engine", "sim", "--model", "m",
                              "--create", "--name", "w"], env=env, cwd=str(ROOT), stderr=f)
    try:
        wait_for(lambda: err.read_text() or p.poll() is not None, "a line from the worker", timeout=120)
        assert "waiting for the schema migration that host-a:123:abc runs" in err.read_text().splitlines()[0]
        assert p.poll() is None
        r.set(K.SCHEMA_KEY, schema.latest())
        r.delete(K.SCHEMA_LOCK_KEY)
        wait_for(lambda: r.keys(f"{K.ModelKeys('m').base}:hb:*"), "the worker's heartbeat", timeout=120)
    finally:
        p.terminate()
        assert p.wait(60) == 0


def test_a_migration_that_does_not_finish_within_the_bound_is_one_line(redis_url, r):
    r.set(K.SCHEMA_KEY, schema.latest() - 1)
    r.set(K.SCHEMA_LOCK_KEY, "host-a:123:abc", px=120_000)
    p = cli("submit", "examples/prompts.jsonl", url=redis_url, check=False,
            env={"CONDUCTOR_SCHEMA_WAIT_S": "1"})
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2
    assert "waiting for the schema migration" in err[0]
    assert err[-1].startswith("conductor: the schema migration that host-a:123:abc runs has not finished "
                              "within 1 s") and len(err) == 2
    # no migration running: an older schema is refused at once, as before
    r.delete(K.SCHEMA_LOCK_KEY)
    with pytest.raises(SchemaMismatch, match="run `conductor migrate`"):
        schema.check(r)
