"""Memory: streams are trimmed, never below a pending batch; a full Redis (maxmemory with
noeviction) refuses a submit with QueueFull and nothing half-written."""

import time

import pytest

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.errors import QueueFull
from conductor.jobs.retention import trim_job_results, trim_model
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
from tests.conftest import item
from tests.helpers import MK, drain, quick, results_for

ONE = Contract(model="m", max_batch_size=1, max_batch_tokens=8192, max_input_len=4096)
C = Contract(model="m", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096)


def model_dump(r, model: str = "m") -> dict[bytes, bytes]:
    return {k: r.dump(k) for k in r.scan_iter(match=f"cdr:{{{model}}}:*", count=1000)}


def test_trim_never_passes_the_oldest_pending_batch(cdr):
    quick(cdr)
    cdr.submit([item(f"{i:04d}", 10, payload="x" * 200) for i in range(600)], "j")
    batches = [cdr.claim(ONE, f"w{i % 3}")[0] for i in range(600)]
    keep = {100, 400, 599}
    for i, b in enumerate(batches):
        if i not in keep:
            cdr.complete(b, results_for(b))
    res = trim_model(cdr, "m")
    assert res["oldest_pending"] == batches[100].batch_id
    info = cdr.r.xinfo_stream(MK.batches)
    assert info["first-entry"][0].decode() == batches[100].batch_id and info["length"] == 3
    assert {p["message_id"].decode() for p in cdr.r.xpending_range(MK.batches, K.GROUP, "-", "+", 10)} == \
        {batches[i].batch_id for i in keep}
    # the survivors still complete, then an idle model's stream empties and claims go on
    for i in keep:
        assert cdr.complete(batches[i], results_for(batches[i])) == (1, 1)
    assert trim_model(cdr, "m")["oldest_pending"] == ""
    assert cdr.r.xlen(MK.batches) == 0
    cdr.submit([item("late", 10)], "j")
    b, _ = cdr.claim(ONE, "w")
    assert b.batch_id > batches[-1].batch_id  # ids keep growing after the trim
    cdr.complete(b, results_for(b))
    assert cdr.status("j")["completed"] == 601 and len(cdr.read_results("j")) == 601


def test_trim_keeps_the_newest_finished_entries(cdr):
    cdr.ensure_model("m")
    for i in range(30):
        cdr.r.xadd(MK.finished, {"inst": f"s:{i}", "batches": 1, "ms": 0})
    assert trim_model(cdr, "m", finished_keep=10)["finished"] == 20
    assert [f[b"inst"] for _, f in cdr.r.xrange(MK.finished)][0] == b"s:20"


def test_results_retention_waits_for_the_job_to_finish(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(4)], "j")
    b, _ = cdr.claim(Contract(model="m", max_batch_size=2, max_batch_tokens=8192, max_input_len=4096), "w")
    cdr.complete(b, results_for(b))
    cut = int(time.time() * 1000) + 1
    with pytest.raises(Exception, match="BUSY job has 2 items without a result"):
        trim_job_results(cdr, "j", cut)
    assert len(cdr.read_results("j")) == 2
    drain(cdr, C)
    time.sleep(0.01)
    assert trim_job_results(cdr, "j", cut) == 2
    assert sorted(r.id for r in cdr.read_results("j")) == ["2", "3"]
    assert cdr.submit([item(0, 10)], "j").duplicates == 1  # a trimmed item is still done


def test_maxmemory_refuses_a_submit_with_queue_full_and_writes_nothing(tmp_path):
    (tmp_path / "r").mkdir()
    extra = ["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]
    with EmbeddedRedis(dir=str(tmp_path / "r"), extra=extra) as srv:
        cdr = Conductor(connect(srv.url))
        quick(cdr)
        accepted, n = 0, 0
        while True:
            chunk = [item(f"{n + k}", 10 + k, prefix=(f"s{n % 3}",), payload="y" * 20_000) for k in range(10)]
            before = model_dump(cdr.r)
            try:
                accepted += cdr.submit(chunk, "j").accepted
            except QueueFull as e:
                assert "maxmemory reached" in str(e)
                break
            n += 10
            assert n < 2000, "maxmemory never refused a submit"
        assert accepted == n > 0
        assert model_dump(cdr.r) == before  # the refused call left every key of the model as it was
        st = cdr.status("j")
        assert (st["submitted"], st["pending"]) == (n, n)
        assert cdr.r.hlen(MK.job_sums("j")) == n
        # still full: workers keep draining (claim, complete, reclaim and fail are allow-oom scripts),
        # so a full Redis empties instead of jamming
        drain(cdr, C)
        assert cdr.status("j")["pending"] == 0
        cdr.r.config_set("maxmemory", 0)
        assert sorted(int(r.id) for r in cdr.read_results("j")) == list(range(n))


def test_a_fresh_worker_drains_a_redis_over_maxmemory_and_verify_runs(tmp_path):
    """Issue 13: over maxmemory (noeviction) a new worker died on HSETNX cfg at registration, its
    heartbeat SET was refused, and `inspect --verify` failed (Redis refuses MULTI there). Now
    registration, heartbeats, the sweep and verify go through allow-oom scripts or plain reads."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, cli
    (tmp_path / "r").mkdir()
    with EmbeddedRedis(dir=str(tmp_path / "r"), extra=["--maxmemory-policy", "noeviction"]) as srv:
        cdr = Conductor(connect(srv.url))
        quick(cdr)
        n = 300
        cdr.submit([item(f"{k}", 10 + k % 50, prefix=(f"s{k % 3}",), payload="y" * 2_000) for k in range(n)], "j")
        used = int(cdr.r.info("memory")["used_memory"])
        cdr.r.config_set("maxmemory", used // 2)  # well past the limit: every plain write is refused
        with pytest.raises(Exception, match="OOM|maxmemory"):
            cdr.r.hsetnx(MK.cfg, "quiet_ms", 1)
        p = subprocess.run([sys.executable, "-m", "conductor", "--redis", srv.url, "worker", "--engine", "sim",
                            "--model", "m", "--name", "fresh", "--max-batch-size", "16", "--idle-exit", "1.5",
                            "--heartbeat-ttl", "0.6"], cwd=str(ROOT), capture_output=True, timeout=120)
        err = p.stderr.decode()
        assert p.returncode == 0, err[-3000:]
        for bad in ("heartbeat_failed", "maintenance_failed", "OOM", "OutOfMemory", "Traceback"):
            assert bad not in err, err[-3000:]
        assert '"event": "registered"' in err
        assert int(cdr.r.info("memory")["used_memory"]) > int(cdr.r.config_get("maxmemory")["maxmemory"])
        st = cdr.status("j")
        assert (st["completed"], st["pending"]) == (n, 0)
        v = cli("inspect", "m", "--verify", url=srv.url, check=False)
        assert v.returncode == 0, v.stdout.decode() + v.stderr.decode()
        assert "over maxmemory" in v.stdout.decode()
        doc = json.loads(cli("inspect", "m", "--verify", "--json", url=srv.url).stdout)[0]
        assert doc["differ"] == 0 and not doc["problems"]
        cdr.r.config_set("maxmemory", 0)
        assert sorted(int(r.id) for r in cdr.read_results("j")) == list(range(n))
