"""deploy/redis/users.acl on a real redis-server started with --aclfile: each role does its job
(real CLI and worker processes) and cannot do the others'."""

import json
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from conductor.client import Conductor, connect
from conductor.embedded import free_port
from conductor.errors import RedisUnavailable
from conductor.records import Contract
from tests.conftest import ROOT, cli, item
from tests.helpers import MK, quick, results_for
from tests.secure_redis import SecureRedis

ACL = ROOT / "deploy" / "redis" / "users.acl"
ROLES = ("producer", "worker", "reader", "admin")
C = Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096)
# a refused command, and one refused inside a script
NOPERM = r"(?i)noperm|no permissions|can't run this command"


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory) -> Iterator[dict[str, str]]:
    d: Path = tmp_path_factory.mktemp("acl")
    pw = {role: secrets.token_hex(16) for role in ROLES}
    text = ACL.read_text()
    for role in ROLES:
        assert f">CHANGE-ME-{role} " in text, f"users.acl has no placeholder password for {role}"
        text = text.replace(f">CHANGE-ME-{role} ", f">{pw[role]} ")
    (d / "users.acl").write_text(text)
    port = free_port()
    urls = {role: f"redis://{role}:{pw[role]}@127.0.0.1:{port}/0" for role in ROLES}
    srv = SecureRedis(d, ["--port", str(port), "--aclfile", str(d / "users.acl")],
                      lambda: redis.Redis.from_url(urls["admin"])).start()
    yield urls
    srv.stop()


@pytest.fixture()
def urls(acl_server) -> dict[str, str]:
    redis.Redis.from_url(acl_server["admin"]).flushall()
    return acl_server


def snapshot(urls) -> dict[bytes, bytes]:
    admin = redis.Redis.from_url(urls["admin"])
    return {k: admin.dump(k) for k in admin.scan_iter(match="*")}


def denied(fn, *args, **kw) -> None:
    with pytest.raises(redis.ResponseError) as e:
        fn(*args, **kw)
    assert re.search(NOPERM, str(e.value)), str(e.value)


def test_no_credentials_no_access(urls):
    port = urls["admin"].rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(RedisUnavailable, match="refused the credentials"):
        connect(f"redis://127.0.0.1:{port}/0", timeout=1)
    with pytest.raises(RedisUnavailable, match="refused the credentials") as e:
        connect(f"redis://producer:wrong-secret@127.0.0.1:{port}/0", timeout=1)
    assert "wrong-secret" not in str(e.value) and "producer:***@" in str(e.value)  # no password in logs


def test_producer_submits_and_cannot_delete_flush_or_claim(urls):
    prod = Conductor.from_url(urls["producer"])
    quick(prod)
    assert prod.submit([item(i, 10) for i in range(20)], "j").accepted == 20
    assert prod.status("j")["pending"] == 20
    before = snapshot(urls)
    r = prod.r
    denied(r.xdel, MK.lane("x:1", 0), "0-1")
    denied(r.delete, MK.state)
    denied(r.flushall)
    denied(r.flushdb)
    denied(r.set, MK.heartbeat("fake"), 1)  # SET only on the schema key
    denied(r.set, "elsewhere", 1)  # keys outside cdr:*
    denied(r.config_set, "maxmemory", "1")
    denied(r.script_flush)
    # claim.lua run as the producer stops at the first command it may not run
    with pytest.raises(redis.ResponseError, match=NOPERM):
        prod.claim(C, "sneaky")
    after = snapshot(urls)
    assert after.keys() == before.keys()
    assert r.xlen(MK.batches) == 0 and prod.status("j")["pending"] == 20


def test_worker_runs_a_job_and_cannot_flush_or_reconfigure(urls, tmp_path):
    prod = Conductor.from_url(urls["producer"])
    quick(prod)
    prod.submit([item(i, 10 + i % 30) for i in range(300)], "j")
    # a real worker process under the worker user: register, heartbeat, maintenance, claim, complete
    p = subprocess.run([sys.executable, "-m", "conductor", "--redis", urls["worker"], "--log-level", "warning",
                        "worker", "--engine", "sim", "--model", "m", "--name", "w1", "--idle-exit", "1.5",
                        "--heartbeat-ttl", "1"], cwd=str(ROOT), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert not re.search(NOPERM.encode(), p.stderr), p.stderr.decode()[-2000:]
    st = prod.status("j")
    assert (st["completed"], st["pending"]) == (300, 0)
    # the failure paths and the sweep, as the worker user
    w = Conductor.from_url(urls["worker"])
    prod.submit([item(f"x{i}", 10) for i in range(4)], "j")
    b, _ = w.claim(C, "w2")
    assert w.fail(b, "w2", "engine error") == (4, 0)
    b, _ = w.claim(C, "w3")
    assert w.reclaim_dead("m")["items"] == 4
    written = 0
    while (b := w.claim(C, "w4")[0]) is not None:  # third delivery: each item travels alone
        written += w.complete(b, results_for(b, "w4"))[0]
    assert written == 4 and prod.status("j")["pending"] == 0
    from conductor.retention import trim_model
    trim_model(w, "m")
    r = w.r
    denied(r.flushall)
    denied(r.flushdb)
    denied(r.keys, "*")
    denied(r.config_set, "appendonly", "no")
    denied(r.script_flush)
    denied(r.set, "elsewhere", 1)
    denied(r.acl_setuser, "reader", enabled=True, commands=["+@all"])
    denied(r.shutdown)


def test_reader_reads_and_cannot_submit_or_write(urls, tmp_path):
    prod = Conductor.from_url(urls["producer"])
    quick(prod)
    prod.submit([item(i, 10) for i in range(5)], "j")
    w = Conductor.from_url(urls["worker"])
    b, _ = w.claim(C, "w")
    w.complete(b, results_for(b))
    # its job, through the command line: status, results, inspect
    st = json.loads(cli("status", "j", "--json", url=urls["reader"]).stdout)
    assert (st["completed"], st["pending"]) == (5, 0)
    out = tmp_path / "r.jsonl"
    cli("results", "j", "-o", str(out), url=urls["reader"])
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == ["0", "1", "2", "3", "4"]
    assert json.loads(cli("inspect", "m", "--json", url=urls["reader"]).stdout)[0]
    before = snapshot(urls)
    reader = Conductor.from_url(urls["reader"])
    with pytest.raises(redis.ResponseError, match=NOPERM):
        reader.submit([item(99, 10)], "j")
    with pytest.raises(redis.ResponseError, match=NOPERM):
        reader.claim(C, "r")
    r = reader.r
    denied(r.evalsha, "0" * 40, 0)
    denied(r.eval, "return 1", 0)
    denied(r.xadd, MK.job_results("j"), {"id": "fake"})
    denied(r.hset, MK.job("j"), "completed", 0)
    denied(r.xdel, MK.job_results("j"), "0-1")
    denied(r.flushall)
    assert snapshot(urls) == before
    p = cli("submit", str(out), "--job", "j2", url=urls["reader"], check=False)
    assert p.returncode != 0


def test_worker_claim_that_starts_a_warming_shape(urls):
    """Issue 13: claim.lua published a 'warming' event after its writes, which the shipped ACL
    (resetchannels) refused: the claim failed halfway and its items were lost."""
    prod = Conductor.from_url(urls["producer"])
    quick(prod, budget_tokens=64, budget_items=4, activate_batches=1, prewarm_batches=2, quiet_ms=60000)
    prod.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(12)], "j")
    prod.submit([item(f"b{i}", 10, prefix=("B",)) for i in range(10)], "j")
    w = Conductor.from_url(urls["worker"])
    b, why = w.claim(Contract(model="m", max_batch_size=4, max_batch_tokens=64, max_input_len=4096), "w")
    assert why == "batch" and len(b.items) == 4 and b.warming
    from conductor.verify import verify
    assert verify(redis.Redis.from_url(urls["admin"]), "m", items=True).ok
