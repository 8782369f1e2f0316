"""deploy/redis/users.acl on a real redis-server started with --aclfile: each role does its job
(real CLI and worker processes) and cannot do the others'."""

import json
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from conductor.client import Conductor, connect
from conductor.embedded import free_port
from conductor.errors import RedisUnavailable
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
from tests.conftest import ROOT, cli, item
from tests.helpers import MK, quick, results_for
from tests.secure_redis import SecureRedis

ACL = ROOT / "deploy" / "redis" / "users.acl"
ROLES = ("producer", "worker", "reader", "admin")
C = Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096)
# a refused command, and one refused inside a script
NOPERM = r"(?i)noperm|no permissions|can't run this command|can't access"


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
    quick(Conductor.from_url(urls["admin"]))
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
    quick(Conductor.from_url(urls["admin"]))
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
    from conductor.jobs.retention import trim_model
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
    quick(Conductor.from_url(urls["admin"]))
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
    p = cli("submit", "--create", str(out), "--job", "j2", url=urls["reader"], check=False)
    assert p.returncode != 0


def test_worker_claim_that_starts_a_warming_shape(urls):
    """Issue 13: claim.lua published a 'warming' event after its writes, which the shipped ACL
    (resetchannels) refused: the claim failed halfway and its items were lost."""
    prod = Conductor.from_url(urls["producer"])
    quick(Conductor.from_url(urls["admin"]), budget_tokens=64, budget_items=4, activate_batches=1, prewarm_batches=2,
          quiet_ms=60000)
    prod.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(12)], "j")
    prod.submit([item(f"b{i}", 10, prefix=("B",)) for i in range(10)], "j")
    w = Conductor.from_url(urls["worker"])
    b, why = w.claim(Contract(model="m", max_batch_size=4, max_batch_tokens=64, max_input_len=4096), "w")
    assert why == "batch" and len(b.items) == 4 and b.warming
    from conductor.verify import verify
    assert verify(redis.Redis.from_url(urls["admin"]), "m", items=True).ok


def test_producer_cannot_falsify_counters_results_config_or_reclaimed(urls):
    """Issue 13: every one of these succeeded as `producer` under the schema-2 users.acl."""
    quick(Conductor.from_url(urls["admin"]))
    prod = Conductor.from_url(urls["producer"])
    prod.submit([item(i, 10) for i in range(6)], "j")
    w = Conductor.from_url(urls["worker"])
    b, _ = w.claim(C, "w")
    w.complete(b, results_for(b)[:2], final=False)
    before = snapshot(urls)
    r = prod.r
    denied(r.hset, MK.state, "completed", 999)
    denied(r.hset, MK.state, "paused", 1)
    denied(r.hset, MK.cfg, "max_deliveries", 0)
    denied(r.hincrby, MK.job("j"), "completed", 5)
    denied(r.hset, MK.job_items("j"), "3", "d")
    denied(r.xadd, MK.job_results("j"), {"id": "3", "r": "{}"})
    denied(r.rpush, MK.reclaimed, "junk")
    denied(r.xadd, MK.batches, {"n": 1})
    denied(r.xadd, MK.dead, {"id": "x"})
    denied(r.hset, MK.affinity, "w", "x:1")
    denied(r.hset, MK.workers, "w", "{}")
    denied(r.spop, K.MODELS_KEY)
    denied(r.srem, K.MODELS_KEY, "m")
    denied(r.delete, MK.lane("x:1", 0))
    denied(r.set, MK.heartbeat("w"), 1)
    # a script runs its commands as the caller: one that marks an item done is refused too
    with pytest.raises(redis.ResponseError, match=NOPERM):
        r.eval("return redis.call('HSET', KEYS[1], '3', 'd')", 1, MK.job_items("j"))
    with pytest.raises(redis.ResponseError, match=NOPERM):
        r.eval("return redis.call('HINCRBY', KEYS[1], 'completed', 5)", 1, MK.state)
    # the worker-side scripts stop at their ACL pre-check, nothing written
    for call in (lambda: prod.complete(b, results_for(b)), lambda: prod.fail(b, "w", "x"),
                 lambda: prod.reclaim_dead("m")):
        with pytest.raises(Exception, match=NOPERM):
            call()
    with pytest.raises(Exception, match=NOPERM):
        prod.set_config("m", {"max_deliveries": 0})
    assert snapshot(urls) == before
    st = prod.status("j")
    assert (st["submitted"], st["completed"], st["pending"]) == (6, 2, 4)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return path


def test_a_whole_job_with_producer_worker_and_reader_users(urls, tmp_path):
    """Issue 13's end-to-end run under users.acl: the producer submits from the CLI (two shapes, so
    one warms), a worker user dead-letters an item, reclaims a dead consumer's batch, and a real
    worker process drains the rest; the reader follows it all; nothing lost, nothing twice."""
    admin = Conductor.from_url(urls["admin"])
    quick(admin, budget_tokens=64, budget_items=4, activate_batches=1, prewarm_batches=2, max_deliveries=1)
    rows = [{"id": f"a{i}", "model": "m", "prefix": ["A"], "prompt": "x", "input_tokens": 10, "max_tokens": 4}
            for i in range(12)]
    rows += [{"id": f"b{i}", "model": "m", "prefix": ["B"], "prompt": "y", "input_tokens": 10, "max_tokens": 4}
             for i in range(10)]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    p = cli("submit", "--create", str(src), "--job", "e2e", url=urls["producer"], check=False)
    assert p.returncode == 0, p.stderr.decode()
    w = Conductor.from_url(urls["worker"])
    c4 = Contract(model="m", max_batch_size=4, max_batch_tokens=64, max_input_len=4096)
    b, why = w.claim(c4, "w1")
    assert why == "batch" and b.warming  # the second shape warms
    # blamed failure at max_deliveries=1: its items go to the dead letter with a failed result
    assert w.fail(b, "w1", "engine error") == (0, len(b.items))
    # a consumer that dies holding a batch (no heartbeat): its batch is reclaimed (not blamed
    # for the death once max_deliveries is back above 1)
    admin.set_config("m", {"max_deliveries": 5})
    b2, _ = w.claim(c4, "ghost")
    assert b2 is not None and w.reclaim_dead("m")["items"] == len(b2.items)
    p = subprocess.run([sys.executable, "-m", "conductor", "--redis", urls["worker"], "--log-level", "warning",
                        "worker", "--engine", "sim", "--model", "m", "--name", "w2", "--idle-exit", "1.5",
                        "--max-batch-size", "4", "--max-batch-tokens", "64", "--heartbeat-ttl", "1"],
                       cwd=str(ROOT), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert not re.search(NOPERM.encode(), p.stderr), p.stderr.decode()[-2000:]
    st = json.loads(cli("status", "e2e", "--json", url=urls["reader"]).stdout)
    assert (st["submitted"], st["failed"], st["pending"]) == (22, len(b.items), 0)
    assert st["completed"] == 22 - len(b.items)
    out = tmp_path / "out.jsonl"
    cli("results", "e2e", "-o", str(out), url=urls["reader"])
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every item once
    assert cli("inspect", "m", "--verify", url=urls["reader"], check=False).returncode == 0
    dead = cli("dead-letter", "list", url=urls["reader"]).stdout.decode()
    assert all(it.id in dead for it in b.items)


READS = (("status", "J"), ("status", "J", "--json"), ("results", "J"), ("jobs",), ("jobs", "--json"),
         ("inspect", "m"), ("inspect", "m", "--lanes"), ("inspect", "m", "--verify"), ("inspect", "--verify"),
         ("dead-letter", "list"), ("config", "m"))


def test_each_documented_command_as_each_role(urls, tmp_path):
    """deploy/redis/README.md's table: each role runs what it is given there, and a command it
    is not given fails in one line with exit 2 and writes nothing."""
    quick(Conductor.from_url(urls["admin"]))
    src = _jsonl(tmp_path / "in.jsonl", [{"id": str(i), "model": "m", "prompt": "p", "input_tokens": 8,
                                          "max_tokens": 4} for i in range(6)])
    assert cli("submit", "--create", str(src), "--job", "J", url=urls["producer"], check=False).returncode == 0
    w = Conductor.from_url(urls["worker"])
    b, _ = w.claim(C, "w")
    w.complete(b, results_for(b))
    # The reads write nothing: each role's run side by side (each command is its own process).
    with ThreadPoolExecutor(4) as pool:
        runs = [(role, args, pool.submit(cli, *args, url=urls[role], check=False))
                for role in ("producer", "worker", "reader", "admin") for args in READS]
        for role, args, run in runs:
            p = run.result()
            assert p.returncode == 0, (role, args, p.stderr.decode()[-500:])
    cli("reclaim", "m", url=urls["worker"])
    cli("trim-results", "J", "--older-than-s", "86400", url=urls["worker"])
    before = snapshot(urls)
    refused = {"reader": [("submit", "--create", str(src), "--job", "J2"), ("config", "m", "quiet_ms=1"),
                          ("pause", "m"),
                          ("trim-results", "J", "--older-than-s", "0")],
               "producer": [("config", "m", "quiet_ms=1"), ("pause", "m"),
                            ("trim-results", "J", "--older-than-s", "0")]}
    for role, cmds in refused.items():
        for args in cmds:
            p = cli(*args, url=urls[role], check=False)
            err = p.stderr.decode()
            assert p.returncode == 2, (role, args, p.returncode, err[-500:])
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (role, args, err)
    assert snapshot(urls) == before


def test_disk_tier_as_producer_and_worker_users(urls, tmp_path):
    """deploy/redis/users.acl lets a producer register store segments (M:segs, M:seg:*) and a worker
    feed them. A producer that tries to feed places the items (submit.lua is its script) but cannot
    drop the index record (ZREM, DEL): the worker's feed then places nothing twice and drops it."""
    from conductor.tier.feeder import Feeder
    from conductor.tier.object_store import Store
    store = Store(str(tmp_path / "store"))
    admin = Conductor.from_url(urls["admin"])
    quick(admin, resident_tokens=100)
    prod = Conductor.from_url(urls["producer"], store=store)
    assert prod.submit([item(i, 10) for i in range(30)], "j").accepted == 30
    assert admin.r.zcard(MK.segs) > 0 and int(admin.r.hget(MK.intake, "stored_items")) == 20
    quick(admin, resident_tokens=10_000)
    segs = admin.r.zcard(MK.segs)
    first = int(admin.r.hget(MK.seg(admin.r.zrange(MK.segs, 0, 0)[0].decode()), "items"))
    with pytest.raises(redis.ResponseError):
        Feeder(prod, store, "m").feed()
    assert admin.r.zcard(MK.segs) == segs  # nothing dropped
    worker = Conductor.from_url(urls["worker"], store=store)
    f = Feeder(worker, store, "m")
    assert f.feed() == 20 - first  # the producer's attempt placed the first segment's items
    assert f.loaded_segments == segs and admin.r.zcard(MK.segs) == 0
    assert admin.r.hget(MK.intake, "stored_items") == b"0" and admin.r.hget(MK.intake, "items") == b"30"


def test_a_producer_retry_of_dead_lettered_lines_is_refused_before_anything_is_written(urls, tmp_path):
    """conductor retry takes retried lines' dead letters out of the old job (or a dead-letter retry
    answers them twice): a producer's user may not remove them, so its retry is refused, naming
    what to do, with no new job made."""
    from conductor.errors import ConductorError
    from conductor.intake import retry
    admin = Conductor.from_url(urls["admin"])
    quick(admin, max_deliveries=1)
    prod = Conductor.from_url(urls["producer"])
    src = tmp_path / "dl.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "model": "m", "prefix": ["sys"], "prompt": "p",
                                       "input_tokens": 10, "max_tokens": 4}) + "\n" for i in range(2)))
    prod.submit([item(f"d{i}", 10) for i in range(2)], "dl")
    w = Conductor.from_url(urls["worker"])
    w.claim(C, "dead-w")
    w.reclaim_dead("m")
    assert prod.status("dl")["done"]
    p = retry.plan(prod, "dl", str(src))
    with pytest.raises(ConductorError, match="dead letters, which this Redis user may not remove"):
        retry.submit(prod, "dl", "dl.r", str(src), p, str(tmp_path / "dl.r.jsonl"))
    assert admin.r.zscore(K.JOBS_KEY, "dl.r") is None  # no new job
    assert retry.submit(w, "dl", "dl.r", str(src), p, str(tmp_path / "dl.r.jsonl")) == 2  # a worker's user may
