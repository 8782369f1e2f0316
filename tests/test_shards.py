"""A model's shapes sharded over a three-master Redis Cluster (issue 36; conductor/redis_contract/shards.py):
a job end to end through the command line and sim worker processes, every id once, its results merged
and followed; cancel, retry and verify over it; a worker killed mid-batch, its batches reclaimed on
their shard; the count changed 1 -> 3 -> 1 with work waiting, nothing lost nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedCluster
from conductor.redis_contract import keys as K
from conductor.redis_contract import shards as S
from conductor.verify import verify
from tests.conftest import ROOT, cli, follow_with_workers, item
from tests.helpers import results_for


@pytest.fixture(scope="module")
def cluster():
    with EmbeddedCluster(3) as c:
        yield c


def _lines(path, n: int, model: str, shapes: int = 12, start: int = 0) -> None:
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"c{i}", "model": model, "prefix": [f"sys {i % shapes}"], "prompt": "x",
                                "input_tokens": 20 + i % 90, "max_tokens": 8}) + "\n")


def test_shard_names_land_on_their_part_of_the_slots():
    for count in (2, 3, 6):
        names = S.shard_names("llama", count)
        assert [S.slot_of(n) * count // S.SLOTS for n in names] == list(range(count))
        assert {S.fold(n) for n in names} == {"llama"}
    assert S.shard_names("llama", 1) == ["llama"] and S.fold("llama") == "llama"


def test_a_job_over_three_shards_end_to_end_through_the_cli(cluster, tmp_path):
    url, model = cluster.url, "shardy"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    rc = connect(url)
    names = S.shard_names(model, 3)
    assert len({rc.get_node_from_key(f"cdr:{{{n}}}").name for n in names}) == 3
    src = tmp_path / "in.jsonl"
    _lines(src, 1500, model)
    assert cli("submit", str(src), "--job", "sj", url=url).stdout.decode().strip() == "sj"
    c = Conductor(rc)
    per_shard = {n: c.status("sj")["models"].get(n, {}).get("submitted", 0) for n in names}
    assert sum(per_shard.values()) == 1500 and all(per_shard.values()), per_shard
    rows = follow_with_workers(url, "sj", tmp_path / "out.jsonl", [(model, "w1"), (model, "w2")],
                               batch_size=32, batch_tokens=4096, timeout=180)
    ids = Counter(r["id"] for r in rows)
    assert set(ids) == {f"c{i}" for i in range(1500)} and set(ids.values()) == {1}
    assert {r["model"] for r in rows} == {model}
    st = json.loads(cli("status", "sj", "--json", url=url).stdout)
    assert (st["status"], st["submitted"], st["completed"], st["pending"]) == ("completed", 1500, 1500, 0)
    assert list(st["models"]) == [model]
    out = cli("results", "sj", url=url).stdout.decode().splitlines()
    assert Counter(json.loads(x)["id"] for x in out) == ids
    row = next(r for r in json.loads(cli("jobs", "--json", url=url).stdout) if r["job"] == "sj")
    assert (row["state"], row["models"], row["completed"]) == ("completed", [model], 1500), row
    insp = json.loads(cli("inspect", model, "--json", url=url).stdout)
    assert [v["model"] for v in insp] == names and all(v["consumers"] == [] for v in insp), insp
    ver = cli("inspect", model, "--verify", url=url, check=False)
    assert ver.returncode == 0, ver.stdout.decode() + ver.stderr.decode()
    vj = cli("verify-job", "sj", url=url, check=False)
    assert vj.returncode == 0, vj.stdout.decode() + vj.stderr.decode()


def _worker(url: str, model: str, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                             "--model", model, "--name", name, "--max-batch-size", "32", "--max-batch-tokens", "4096",
                             "--max-input-len", "4096", *extra],
                            env=dict(os.environ, CONDUCTOR_REDIS_URL=url), cwd=str(ROOT))


def _once(rows: list[dict], n: int, prefix: str = "c", start: int = 0) -> Counter:
    ids = Counter(r["id"] for r in rows)
    assert set(ids) == {f"{prefix}{i}" for i in range(start, start + n)} and set(ids.values()) == {1}, \
        (len(ids), [i for i, k in ids.items() if k > 1][:5])
    return ids


def test_cancel_retry_and_verify_over_shards(cluster, tmp_path):
    url, model = cluster.url, "cancy"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    src = tmp_path / "in.jsonl"
    _lines(src, 600, model)
    cli("submit", str(src), "--job", "cx", url=url)
    cli("cancel", "cx", url=url)
    st = json.loads(cli("status", "cx", "--json", url=url).stdout)
    assert (st["status"], st["cancelled"], st["pending"]) == ("cancelled", 600, 0), st
    rows = [json.loads(x) for x in cli("results", "cx", url=url).stdout.decode().splitlines()]
    _once(rows, 600)
    assert {r["model"] for r in rows} == {model}
    assert cli("verify-job", "cx", url=url, check=False).returncode == 0
    cli("retry", "cx", "--job", "cx2", url=url)
    rows = follow_with_workers(url, "cx2", tmp_path / "out.jsonl", [(model, "w1")], batch_size=32,
                               batch_tokens=4096, timeout=180)
    _once(rows, 600)
    st = json.loads(cli("status", "cx2", "--json", url=url).stdout)
    assert (st["status"], st["completed"]) == ("completed", 600), st
    assert cli("verify-job", "cx2", url=url, check=False).returncode == 0


def test_a_worker_killed_mid_batch_its_batches_reclaimed_on_their_shard(cluster, tmp_path):
    url, model = cluster.url, "killy"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    src = tmp_path / "in.jsonl"
    _lines(src, 900, model)
    cli("submit", str(src), "--job", "kj", url=url)
    c = Conductor(connect(url))
    names = c.shards(model)
    slow = _worker(url, model, "slow", "--sim-time-scale", "50", "--heartbeat-ttl", "2")
    try:
        held: list[str] = []
        deadline = time.monotonic() + 60
        while not held and time.monotonic() < deadline:
            held = [n for n in names if c.r.exists(K.ModelKeys(n).batches)
                    and c.r.xpending_range(K.ModelKeys(n).batches, K.GROUP, "-", "+", 1, consumername="slow")]
            time.sleep(0.1)
        assert held, "the slow worker never held a batch"
    finally:
        slow.send_signal(signal.SIGKILL)
        slow.wait(10)
    rows = follow_with_workers(url, "kj", tmp_path / "out.jsonl", [(model, "fast")], batch_size=32,
                               batch_tokens=4096, timeout=180)
    _once(rows, 900)
    reclaims = {n: int(c.r.hget(K.ModelKeys(n).state, "reclaims") or 0) for n in names}
    assert all(reclaims[n] >= 1 for n in held), reclaims
    assert any(r["deliveries"] > 1 for r in rows)
    for n in names:
        assert verify(c.r, n, items=True).ok


def test_the_count_changed_1_3_1_with_work_waiting_loses_and_doubles_nothing(cluster, tmp_path):
    url, model = cluster.url, "movy"
    cli("config", model, "--create", "quiet_ms=200", url=url)
    for k, count in enumerate((1, 3, 1)):
        cli("config", model, f"shards={count}", url=url)
        c = Conductor(connect(url))  # a producer that reads the layout now
        c.submit([item(f"c{i}", 20 + i % 90, model=model, prefix=(f"sys {i % 12}",), max_tokens=8)
                  for i in range(300 * k, 300 * k + 300)], "mj")
    assert len([n for n in c.shards(model) if c.status("mj")["models"].get(n, {}).get("submitted")]) == 4
    rows = follow_with_workers(url, "mj", tmp_path / "out.jsonl", [(model, "w1"), (model, "w2")], batch_size=32,
                               batch_tokens=4096, timeout=180)
    _once(rows, 900)
    st = json.loads(cli("status", "mj", "--json", url=url).stdout)
    assert (st["status"], st["completed"], st["pending"]) == ("completed", 900, 0), st
    # drained, the old layout is forgotten (the lease holder does it once it is quiet: shard_maintenance.py)
    assert c.forget_drained(model, quiet_ms=0) == [3]
    assert c.shards(model) == [model]


def test_a_model_made_sharded_before_any_item_has_no_old_layout_to_drain(cluster):
    c = Conductor(connect(cluster.url))
    c.set_config("fresh", {"shards": 3})
    assert c.shards("fresh") == S.shard_names("fresh", 3)
    assert c.config(S.shard_names("fresh", 3)[1])["quiet_ms"] == c.config("fresh")["quiet_ms"]


def test_the_batch_api_over_a_sharded_model(cluster, tmp_path):
    import io
    import urllib.error
    import urllib.request

    from openai import OpenAI

    from conductor.embedded import free_port
    url, model, key = cluster.url, "apim", "sk-test-shards"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "conductor", "serve", "--port", str(port), "--data-dir",
                              str(tmp_path / "files")], env=dict(os.environ, CONDUCTOR_REDIS_URL=url,
                                                                 CONDUCTOR_API_KEYS=key), cwd=str(ROOT))
    w = _worker(url, model, "api-w")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except urllib.error.HTTPError:  # it answers (without a key: 401)
                break
            except OSError:
                assert serve.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": model, "max_tokens": 4,
                          "messages": [{"role": "system", "content": f"be brief {i % 9}"},
                                       {"role": "user", "content": f"question {i}"}]}} for i in range(120)]
        f = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
                                purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while b.status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline + 120, b
            time.sleep(0.2)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed", b.errors
        assert (b.request_counts.total, b.request_counts.completed) == (120, 120)
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(r["custom_id"] for r in rows)
        c = Conductor(connect(url))
        assert len([n for n in S.shard_names(model, 3) if c.status(b.id)["models"].get(n)]) >= 2
    finally:
        w.terminate()
        serve.terminate()
        assert w.wait(30) == 0 and serve.wait(30) == 0


def test_a_tenants_service_on_one_shard_counts_on_the_others(cluster):
    from conductor.jobs.shard_fair import ShardFair
    c = Conductor(connect(cluster.url))
    c.set_config("fairy", {"shards": 3})
    names = c.shards("fairy")
    fair = ShardFair(c.r)
    assert fair.sync(names) == {}  # the first sync only learns the counters
    c.r.hincrbyfloat(K.ModelKeys(names[0]).vtc, "a", 1000)
    c.r.hincrbyfloat(K.ModelKeys(names[1]).vtc, "b", 10)
    assert fair.sync(names) == {"a": 2000, "b": 20}
    vtc = [{k.decode(): float(v) for k, v in c.r.hgetall(K.ModelKeys(n).vtc).items()} for n in names]
    assert vtc == [{"a": 1000, "b": 10}, {"a": 1000, "b": 10}, {"a": 1000, "b": 10}]
    assert fair.sync(names) == {}  # a top-up is not growth to spread again


def test_pause_covers_every_shard(cluster, tmp_path):
    url, model = cluster.url, "pausy"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    src = tmp_path / "in.jsonl"
    _lines(src, 60, model)
    cli("pause", model, url=url)
    assert cli("submit", str(src), "--job", "pj", url=url, check=False).returncode == 2
    cli("resume", model, url=url)
    cli("submit", str(src), "--job", "pj", url=url)
    assert Conductor(connect(url)).status("pj")["submitted"] == 60


def test_the_request_path_of_a_sharded_model_on_the_cluster(cluster):
    # RequestClient and AsyncRequestClient on a ?cluster=1 URL: each request on its shape's shard
    # (its item, seal and reply list in that shard's slot, on that shard's master), answered once
    import asyncio

    from conductor.client.request import AsyncRequestClient, RequestClient
    url, model = cluster.url, "reqy"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    ws = [_worker(url, model, f"req-w{i}") for i in range(2)]
    try:
        c = Conductor(connect(url))
        deadline = time.monotonic() + 30
        while not all(c.r.exists(K.ModelKeys(model).heartbeat(f"req-w{i}")) for i in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        prefixes = [(f"sys {k}",) for k in range(9)]
        with RequestClient(url, model=model, max_in_flight=4) as rc:
            got = [rc.generate(f"hello {k}", prefix=prefixes[k], max_tokens=4, timeout=30, payload={"k": k})
                   for k in range(9)]
            assert [g.payload for g in got] == [{"k": k} for k in range(9)]
            assert all(g.error is None and g.output and g.model == model and g.job == rc.job for g in got)
            cap = rc.capacity()
            assert cap.workers == 2 and cap.waiting_tokens == 0
            job = rc.job

        async def many() -> list:
            async with AsyncRequestClient(url, model=model, max_in_flight=8) as ac:
                out = [ac.job, *await asyncio.gather(*(ac.generate(f"again {k}", prefix=prefixes[k], max_tokens=4,
                                                                    timeout=30) for k in range(9)))]
                # a placed shape on a shard the job is ready on is placed in the event loop, as place() places it
                # (no thread hop); a new shape needs Redis (its shard read and recorded): place_now declines
                core = ac._core
                it = core.item("p", prefixes[0], 4, None)
                now = core.place_now(it)
                assert now is not None and now[1].model == core.place(it)[1].model != model
                assert core.place_now(core.item("p", ("a shape not yet placed",), 4, None)) is None
                return out
        ajob, *agot = asyncio.run(many())
        assert all(g.error is None and g.output and g.model == model for g in agot)
        # the requests went to the shards that hold their shapes (more than one), none to the model's own keys
        shards = S.shard_names(model, 3)
        placed = {int(v) for v in c.r.hvals(K.ModelKeys(model).shard_of)}
        assert len(placed) >= 2
        st = c.status(job)
        assert sum(st["models"].get(n, {}).get("submitted", 0) for n in shards) == 9, st
        assert not st["models"].get(model, {}).get("submitted"), st
        # each answer once, in the job's merged results
        rows = c.read_results(job)
        assert sorted(r.id for r in rows) == sorted(g.id for g in got) and {r.model for r in rows} == {model}
        assert len(c.read_results(ajob)) == 9
        # the shards sit on different masters: the requests reached more than one of them
        masters = {c.r.get_node_from_key(K.ModelKeys(shards[i]).base).port for i in placed}
        assert len(masters) >= 2
    finally:
        for w in ws:
            w.terminate()
        for w in ws:
            assert w.wait(30) == 0


def test_requests_waiting_when_the_count_changes_follow_their_items(cluster):
    # requests wait on three shards with no worker; the count goes 3 -> 1 and the migration moves
    # them to the model's own keys like any item; a worker then answers them there, and each
    # waiting caller, following its item, gets its answer once (they stayed before, and the
    # migration's give-backs counted deliveries until it dead-lettered them)
    import threading

    from conductor.client import shard_migrate
    from conductor.client.request import RequestClient
    url, model = cluster.url, "folly"
    cli("config", model, "--create", "quiet_ms=100", "shards=3", url=url)
    c = Conductor(connect(url))
    w = _worker(url, model, "f-w")
    deadline = time.monotonic() + 30
    while not c.r.exists(K.ModelKeys(model).heartbeat("f-w")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    rc = RequestClient(url, model=model, max_in_flight=8)
    w.terminate()
    assert w.wait(30) == 0
    got: dict[int, object] = {}

    def ask(k: int) -> None:
        try:
            got[k] = rc.generate(f"wait {k}", prefix=(f"sys {k}",), max_tokens=4, timeout=90)
        except Exception as e:  # noqa: BLE001 - the assertion below names it
            got[k] = e
    ts = [threading.Thread(target=ask, args=(k,)) for k in range(6)]
    for t in ts:
        t.start()
    olds = S.shard_names(model, 3)
    while c.status(rc.job)["submitted"] < 6:
        assert time.monotonic() < deadline + 30, (got, c.status(rc.job))
        time.sleep(0.05)
    assert sum(c.status(rc.job)["models"].get(n, {}).get("submitted", 0) for n in olds) == 6
    assert len({int(v) for v in c.r.hvals(K.ModelKeys(model).shard_of)}) >= 2
    c.set_config(model, {"shards": 1})
    assert shard_migrate.old_shards(c, model) == olds
    time.sleep(0.3)  # past quiet_ms
    while not c.drained(olds):
        assert time.monotonic() < deadline + 60, c.status(rc.job)
        shard_migrate.step(c, model, "mv", batches=50)
        time.sleep(0.05)
    st = c.status(rc.job)
    assert st["models"][model]["submitted"] == 6 and not any(st["models"].get(n, {}).get("submitted") for n in olds)
    w = _worker(url, model, "f-w2")
    try:
        for t in ts:
            t.join(60)
        assert all(not t.is_alive() for t in ts)
        assert all(getattr(g, "error", "x") is None and g.output for g in got.values()), got  # type: ignore[attr-defined]
        rows = c.read_results(rc.job)
        assert sorted(r.id for r in rows) == sorted(g.id for g in got.values())  # type: ignore[attr-defined]
    finally:
        rc.close()
        w.terminate()
        assert w.wait(30) == 0


@pytest.mark.parametrize("same_ids", [False, True], ids=["ids", "same-ids"])
def test_a_host_agent_serves_every_shard(redis_url, same_ids):
    import threading

    from conductor.workers.host_agent import HostAgent
    from conductor.workers.worker import WorkerOptions
    from tests.helpers import quick
    c = Conductor(connect(redis_url))
    quick(c, "agy", shards=3)
    if same_ids:  # its GPU processes hold batches of two shards with one id (the failure it had)
        _same_batch_ids(c, "agy")
    c.submit([item(f"a{i}", 10 + i % 40, model="agy", prefix=(f"sys {i % 9}",), max_tokens=8) for i in range(240)],
             "aj")
    used = [n for n in c.shards("agy") if c.status("aj")["models"].get(n)]
    assert len(used) == 3
    spec = {"kind": "sim", "model": "agy", "max_batch_size": 8, "max_batch_tokens": 8192, "max_input_len": 4096,
            "time_scale": 3.0 if same_ids else 0.0}
    opts = WorkerOptions(name="ag", idle_exit_s=1.0, wake="poll" if same_ids else "bell")
    agent = HostAgent(Conductor(connect(redis_url)), spec, 2, opts, depth=8 if same_ids else 2)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    rows = c.read_results("aj")
    _once([{"id": r.id} for r in rows], 240, prefix="a")
    assert {r.model for r in rows} == {"agy"}
    assert all(int(c.r.hget(K.ModelKeys(n).job("aj"), "completed") or 0) > 0 for n in used)


def _same_batch_ids(c: Conductor, model: str) -> list[str]:
    """Every shard of ``model`` issues the same batch ids from here on: each batches stream's last id set
    to one id in the future, so that XADD '*' counts up from it alike on each (two shards issue one id
    in one millisecond by chance; here always). Returns the shards."""
    names = c.shards(model)
    for n in names:
        c.ensure_model(n)
        c.r.execute_command("XSETID", K.ModelKeys(n).batches, "9999999999999-0")
    return names


def test_a_worker_holding_batches_of_two_shards_with_one_id_answers_each(redis_url):
    from conductor.workers.engines.sim import SimEngine
    from conductor.workers.worker import Worker, WorkerOptions
    from tests.helpers import quick
    c = Conductor(connect(redis_url))
    quick(c, "dupy", shards=3)
    names = _same_batch_ids(c, "dupy")
    c.submit([item(f"d{i}", 10 + i % 40, model="dupy", prefix=(f"sys {i % 9}",), max_tokens=8) for i in range(240)],
             "dj", seal=True)
    assert sum(1 for n in names if c.status("dj")["models"].get(n)) == 3
    # batches of 8 into an engine of 32 sequences: the worker holds several at once
    engine = SimEngine("dupy", max_batch_size=8, max_num_seqs=256, time_scale=3.0)
    w = Worker(Conductor(connect(redis_url)), engine,
               WorkerOptions(name="dw", idle_exit_s=1.0, wake="poll", pending_ceiling=1000))
    w.run()
    rows = c.read_results("dj")
    _once([{"id": r.id} for r in rows], 240, prefix="d")
    # the shards did issue one id to several batches (a batch holds one shape, a shape lives on one shard)
    assert len({r.batch for r in rows}) < len({(r.batch, r.shape) for r in rows})
    assert w.finished == 240


def test_a_change_of_count_moves_waiting_shapes_to_their_new_shards(cluster, tmp_path):
    from conductor.client import shard_migrate
    from conductor.redis_contract import script_calls as calls
    from conductor.redis_contract.records import Contract
    from tests.helpers import quick
    url, model = cluster.url, "migy"
    c = Conductor(connect(url))
    quick(c, model)
    c.submit([item(f"g{i}", 10 + i % 60, model=model, prefix=(f"sys {i % 12}",), max_tokens=8)
              for i in range(600)], "gj", seal=True)
    c.set_config(model, {"shards": 3})
    assert shard_migrate.old_shards(c, model) == [model]
    # a migration that died after handing a batch over, before submitting it: the next step resumes it
    time.sleep(0.2)  # past quiet_ms: the old shard dispatches what waits
    batch, why = c.claim(Contract(model=model, max_batch_size=50, max_batch_tokens=1 << 20, max_input_len=4096), "mv")
    assert batch is not None, why
    token = c.r.xrange(K.ModelKeys(model).batches, batch.batch_id, batch.batch_id)[0][1][b"k"].decode()
    assert calls.hand_over(K.ModelKeys(model), batch.batch_id, "mv", token).run(c.scripts) == len(batch.items)
    assert c.status("gj")["submitted"] == 600 - len(batch.items)  # in the moving list, nowhere claimable
    deadline = time.monotonic() + 30
    while not c.drained([model]):
        assert time.monotonic() < deadline, c.status("gj")
        shard_migrate.step(c, model, "mv", batches=50)
        time.sleep(0.05)
    st = c.status("gj")
    assert st["submitted"] == 600 and st["models"][model]["submitted"] == 0, st
    assert all(st["models"][n]["submitted"] for n in S.shard_names(model, 3))
    assert c.forget_drained(model, quiet_ms=0) == [1]
    for n in [model, *S.shard_names(model, 3)]:
        rep = verify(c.r, n, items=True)
        assert rep.ok, (n, rep.drift)
    w = _worker(url, model, "after", "--idle-exit", "2")
    assert w.wait(120) == 0
    rows = [json.loads(r) for r in c.results("gj")]
    _once(rows, 600, prefix="g")
    assert c.status("gj")["done"]


@pytest.mark.slow  # ~30 s: the default run keeps the 1->3->1 change and the migration with work waiting (above)
def test_a_live_model_resharded_1_to_3_mid_run_through_the_cli(cluster, tmp_path):
    # workers running and work waiting when the count changes: the lease holder moves the waiting
    # shapes to the new shards while the workers serve both layouts; every id once
    url, model = cluster.url, "livey"
    cli("config", model, "--create", "quiet_ms=200", url=url)
    src = tmp_path / "in.jsonl"
    _lines(src, 1200, model, shapes=24)
    cli("submit", str(src), "--job", "lj", url=url)
    c = Conductor(connect(url))
    # slow enough that work still waits when the workers see the new count (WORKER_LAYOUT_TTL_S)
    procs = [_worker(url, model, f"lw{i}", "--sim-time-scale", "20") for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        while c.status("lj")["completed"] < 100:
            assert time.monotonic() < deadline, c.status("lj")
            time.sleep(0.1)
        cli("config", model, "shards=3", url=url)
        deadline = time.monotonic() + 180
        while not c.status("lj")["done"]:
            assert time.monotonic() < deadline, c.status("lj")
            time.sleep(0.2)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            assert p.wait(30) == 0
    st = c.status("lj")
    assert sum(st["models"].get(n, {}).get("submitted", 0) for n in S.shard_names(model, 3)) > 0, st  # moved
    rows = [json.loads(x) for x in cli("results", "lj", url=url).stdout.decode().splitlines()]
    _once(rows, 1200)
    assert json.loads(cli("status", "lj", "--json", url=url).stdout)["status"] == "completed"
    for n in [model, *S.shard_names(model, 3)]:
        rep = verify(c.r, n, items=True)
        assert rep.ok, (n, rep.drift)
    assert cli("verify-job", "lj", url=url, check=False).returncode == 0


def test_verify_of_a_sharded_model_with_batches_in_flight_on_every_shard(cluster):
    # verify reads the in-flight set (XPENDING, XRANGE, the reclaimed list) of each shard in one
    # MULTI: on a cluster that is redis-py's cluster pipeline, whose replies must read as on one Redis
    from conductor.redis_contract.records import Contract
    from tests.helpers import quick
    url, model = cluster.url, "flighty"
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    c.submit([item(f"f{i}", 20 + i % 50, model=model, prefix=(f"sys {i % 12}",), max_tokens=8) for i in range(600)],
             "fj")
    names = c.shards(model)
    time.sleep(0.1)  # past quiet_ms
    held = {}
    for n in names:
        contract = Contract(model=n, max_batch_size=16, max_batch_tokens=8192, max_input_len=4096)
        held[n] = [c.claim(contract, "w")[0] for _ in range(2)]
        assert all(held[n]), n
    c.fail(held[names[1]][1], "w", "boom")  # one batch back in its shard's reclaimed list
    for n in names:
        assert int(c.r.hget(K.ModelKeys(n).state, "inflight_batches")) >= 1
    p = cli("inspect", model, "--verify", url=url, check=False)
    text = p.stdout.decode()
    assert p.returncode == 0, text + p.stderr.decode()
    assert "<-- differs" not in text
    docs = json.loads(cli("inspect", model, "--verify", "--json", "--all", url=url).stdout)
    assert [d["model"] for d in docs] == names and all(d["differ"] == 0 for d in docs), docs
    inflight = {d["model"]: next(r["truth"] for r in d["rows"] if r["field"] == "inflight_items") for d in docs}
    assert all(inflight[n] == sum(len(b.items) for b in held[n][:1 if n == names[1] else 2]) for n in names), inflight
    for n in names:  # the ledger too: each queued id in exactly one place, a pending batch's list included
        rep = verify(c.r, n, items=True)
        assert rep.ok, (n, rep.drift, rep.problems)
    assert cli("verify-job", "fj", url=url, check=False).returncode == 0
    # a broken counter of one shard is reported, on that shard
    c.r.hincrby(K.ModelKeys(names[2]).state, "inflight_items", 5)
    p = cli("inspect", model, "--verify", url=url, check=False)
    text = p.stdout.decode()
    assert p.returncode == 1, text
    bad = [ln.split()[:2] for ln in text.splitlines() if "<-- differs" in ln]
    assert bad == [[K.ModelKeys(names[2]).state, "inflight_items"]], text
    c.r.hincrby(K.ModelKeys(names[2]).state, "inflight_items", -5)
    for n in names:
        for b in held[n][:1 if n == names[1] else 2]:
            c.complete(b, results_for(b))
    assert cli("inspect", model, "--verify", url=url, check=False).returncode == 0


def test_an_item_moved_by_a_change_of_count_keeps_its_delivery_count(redis_url):
    # delivered twice to consumers that died (no heartbeat: reclaimed, each time the blamed batch),
    # then S 1 -> 3: on its new shard the next delivery is its third, and with max_deliveries=3 the
    # third death dead-letters it there, as it would have without the move (lua/hand_in.lua)
    from conductor.client import shard_migrate
    from conductor.redis_contract import script_calls as calls
    from conductor.redis_contract.records import Contract
    from tests.helpers import quick
    c, model = Conductor(connect(redis_url)), "dvy"
    quick(c, model, max_deliveries=3)
    c.submit([item("d0", 12, model=model, prefix=("sys",), max_tokens=8)], "dj", seal=True)

    def die_holding_one(name: str, consumer: str) -> int:
        mk = K.ModelKeys(name)
        batch, why = c.claim(Contract(model=name, max_batch_size=8, max_batch_tokens=4096, max_input_len=4096),
                             consumer)
        assert batch is not None and [it.id for it in batch.items] == ["d0"], why
        dv = int(c.r.xrange(mk.batches, batch.batch_id, batch.batch_id)[0][1][b"dv"])
        rep = calls.reclaim(mk, consumer, force=False, min_idle_ms=0, count=10).run(c.scripts)
        assert rep.batches == 1, rep
        return dv

    assert [die_holding_one(model, f"gone{i}") for i in range(2)] == [1, 2]
    c.set_config(model, {"shards": 3})
    # a migration that died after handing the batch over: its moving list names the count, the next
    # step submits it from there
    mk = K.ModelKeys(model)
    batch, why = c.claim(Contract(model=model, max_batch_size=8, max_batch_tokens=4096, max_input_len=4096), "mv")
    assert batch is not None, why
    token = c.r.xrange(mk.batches, batch.batch_id, batch.batch_id)[0][1][b"k"].decode()
    assert calls.hand_over(mk, batch.batch_id, "mv", token).run(c.scripts) == 1
    assert c.r.hget(mk.moving, token).endswith(b":3")
    deadline = time.monotonic() + 10
    while not c.drained([model]):
        assert time.monotonic() < deadline, c.status("dj")
        shard_migrate.step(c, model, "mv")
    [new] = [n for n in S.shard_names(model, 3) if c.status("dj")["models"].get(n, {}).get("submitted")]
    assert die_holding_one(new, "gone2") == 3
    dead = c.r.xrange(K.ModelKeys(new).dead)
    assert [(e[b"id"], e[b"deliveries"]) for _, e in dead] == [(b"d0", b"3")]
    st = c.status("dj")
    assert st["submitted"] == 1 and st["failed"] == 1 and st["done"], st
    for n in [model, *S.shard_names(model, 3)]:
        rep = verify(c.r, n, items=True)
        assert rep.ok, (n, rep.drift)
