"""Chaos on the Redis Cluster under a sharded model mid-run (issue 36): a shard's slot moved live
to another master the way `redis-cli --cluster reshard` moves it, and a master failed over to
its replica, while sim worker processes serve the job. Every id answered once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
import redis

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedCluster
from conductor.redis_contract import keys as K
from conductor.redis_contract import shards as S
from conductor.verify import verify
from conductor.workers.outage import Link
from tests.conftest import ROOT, cli


def _lines(path, n: int, model: str, shapes: int = 12) -> None:
    with open(path, "w") as f:
        for i in range(n):
            row = {
                "id": f"c{i}",
                "model": model,
                "prefix": [f"sys {i % shapes}"],
                "prompt": "x",
                "input_tokens": 20 + i % 90,
                "max_tokens": 8,
            }
            f.write(json.dumps(row) + "\n")


def _worker(url: str, model: str, name: str, *extra: str, log=None) -> subprocess.Popen:
    """A sim worker process; ``log``: a folder for its log lines (shown when the test fails)."""
    cmd = [sys.executable, "-m", "conductor", "--log-level", "info" if log else "warning", "worker"]
    cmd += ["--engine", "sim", "--model", model, "--name", name, "--max-batch-size", "32"]
    cmd += ["--max-batch-tokens", "4096", "--max-input-len", "4096", *extra]
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    if log is None:
        return subprocess.Popen(cmd, env=env, cwd=str(ROOT))
    with open(log / f"{name}.log", "w") as out:  # the child keeps its own copy of the file
        return subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT)


def _once(rows: list[dict], n: int) -> None:
    ids = Counter(r["id"] for r in rows)
    missing = {f"c{i}" for i in range(n)} - set(ids)
    doubled = [i for i, k in ids.items() if k > 1]
    assert not missing and not doubled, (len(ids), sorted(missing)[:5], doubled[:5])


def _longest_pause(rows: list[dict], t0: float, t1: float) -> float:
    """The longest time without an answer (the results' finished_at) around the span t0..t1 (time.time()
    seconds): how long the job stalled while the cluster changed under it."""
    at = sorted(r["finished_at"] / 1000 for r in rows)
    return max((b - a for a, b in zip(at, at[1:], strict=False) if b >= t0 and a <= t1), default=0.0)


def _owner(cluster: EmbeddedCluster, name: str) -> int:
    rc = connect(cluster.url)
    try:
        port = rc.get_node_from_key(f"cdr:{{{name}}}").port
    finally:
        rc.close()
    return [n.port for n in cluster.nodes].index(port)


@pytest.fixture(scope="module")
def cluster():
    with EmbeddedCluster(3) as c:
        yield c


def _sharded_job(url: str, tmp_path, model: str, n: int) -> tuple[Conductor, list[str]]:
    """A 3-shard model with a job of ``n`` items (its name the model's) submitted through the CLI;
    a client and the shards' names."""
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    src = tmp_path / "in.jsonl"
    _lines(src, n, model)
    cli("submit", str(src), "--job", model, url=url)
    c = Conductor(connect(url))
    return c, c.shards(model)


def _until_a_fifth_answered(c: Conductor, model: str, n: int, procs: list[subprocess.Popen]) -> None:
    """Wait (60 s at most) until a fifth of the job's ``n`` items are answered, every worker alive."""
    deadline = time.monotonic() + 60
    while c.status(model)["completed"] < n // 5:
        assert time.monotonic() < deadline, c.status(model)
        assert all(p.poll() is None for p in procs)
        time.sleep(0.05)


def _run_with_slot_moves(
    cluster: EmbeddedCluster, tmp_path, model: str, n: int, moves: int, page_pause_s: float
) -> list[float]:
    """A job of ``n`` items over 3 shards served by two sim worker processes; once a fifth is
    answered, ``moves`` live slot moves, each shard's slot in turn to the next master. Every id
    answered once, each worker alive to the end and exiting 0, every shard verified with its ledger.
    The seconds each move took."""
    url = cluster.url
    c, names = _sharded_job(url, tmp_path, model, n)
    procs = [_worker(url, model, f"w{i}", "--sim-time-scale", "2") for i in range(2)]
    took = []
    try:
        _until_a_fifth_answered(c, model, n, procs)
        wall0 = time.time()
        for k in range(moves):
            name = names[k % 3]
            to = (_owner(cluster, name) + 1) % 3
            t0 = time.monotonic()
            cluster.move_slot(S.slot_of(name), to, page_pause_s=page_pause_s)
            took.append(time.monotonic() - t0)
            assert _owner(cluster, name) == to
        wall1 = time.time()
        deadline = time.monotonic() + 120
        while not c.status(model)["done"]:
            assert time.monotonic() < deadline, c.status(model)
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]  # rode it out
            time.sleep(0.1)
    finally:
        for p in procs:
            p.terminate()
        codes = [p.wait(30) for p in procs]
    assert codes == [0, 0]
    rows = [json.loads(x) for x in cli("results", model, url=url).stdout.decode().splitlines()]
    _once(rows, n)
    st = json.loads(cli("status", model, "--json", url=url).stdout)
    assert (st["status"], st["completed"]) == ("completed", n), st
    for name in names:
        rep = verify(c.r, name, items=True)
        assert rep.ok, (name, rep.drift, rep.problems)
    c.r.close()
    pause = _longest_pause(rows, wall0, wall1)
    print(f"{moves} slot moves, {sum(took):.2f} s in all; longest pause in answers {pause:.2f} s")
    return took


def test_a_shards_slot_moved_live_mid_run_every_id_once(cluster, tmp_path):
    # one move, its keys half moved for a while (a pause after each MIGRATE of 10 keys, as a big
    # slot would be): the workers' scripts on that shard are refused (TRYAGAIN) and retried
    _run_with_slot_moves(cluster, tmp_path, "slotty", 600, 1, page_pause_s=0.15)


@pytest.mark.chaos
def test_every_shards_slot_moved_again_and_again_mid_run_every_id_once(cluster, tmp_path):
    took = _run_with_slot_moves(cluster, tmp_path, "movey", 3000, 9, page_pause_s=0.1)
    print(f"median move {sorted(took)[4]:.2f} s")


def test_no_script_runs_on_a_half_moved_slot(cluster):
    # The conductor's scripts build key names from cdr:{model} and declare it (never a key) among
    # their KEYS: while a slot's keys are half moved, the source answers ASK and the target
    # TRYAGAIN, so no script runs on half of the keys. Refused, nothing written; once the move
    # ends the same calls go through. (A client that retries rides it out: the test above.)
    from redis.exceptions import AskError, ClusterError, TryAgainError

    from conductor.redis_contract.records import Contract
    from tests.conftest import item
    from tests.helpers import drain, quick, results_for

    url, model = cluster.url, "halfy"
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    c.submit([item(f"h{i}", 10 + i % 30, model=model, prefix=(f"sys {i % 9}",)) for i in range(300)], "hj")
    name = c.shards(model)[0]
    contract = Contract(model=name, max_batch_size=16, max_batch_tokens=8192, max_input_len=4096)
    time.sleep(0.1)  # past quiet_ms
    held = c.claim(contract, "w")[0]
    assert held is not None
    slot, frm = S.slot_of(name), _owner(cluster, name)
    to = (frm + 1) % 3
    src, dst = (redis.Redis(port=cluster.nodes[i].port) for i in (frm, to))
    ids = [x.execute_command("CLUSTER", "MYID").decode() for x in (src, dst)]
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[0])
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[1])
    keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    assert len(keys) > 10
    src.execute_command("MIGRATE", "127.0.0.1", cluster.nodes[to].port, "", 0, 5000, "KEYS", *keys[: len(keys) // 2])

    def dumps() -> dict:
        out = {}
        for node in (src, dst):
            for k in node.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
                pipe = node.pipeline(transaction=False)  # ASKING: the importing node serves the next command
                pipe.execute_command("ASKING")
                pipe.dump(k)
                out[(node.connection_pool.connection_kwargs["port"], k)] = pipe.execute()[1]
        return out

    before = dumps()
    strict = Conductor(connect(url, retries=0))  # refusals raised, not retried
    refused = (AskError, ClusterError, TryAgainError)
    with pytest.raises(refused):
        strict.complete(held, results_for(held))
    with pytest.raises(refused):
        strict.claim(contract, "w2")
    with pytest.raises(refused):
        strict.fail(held, "w", "boom")
    with pytest.raises(refused):
        strict.submit([item("late", 10, model=model, prefix=tuple(held.prefix))], "hj")  # a shape of this shard
    assert dumps() == before  # nothing written on either node
    cluster.move_slot(slot, to)  # the rest of the keys, then the slot's new owner on every node
    assert _owner(cluster, name) == to
    c.complete(held, results_for(held))
    for n in c.shards(model):
        drain(c, Contract(model=n, max_batch_size=16, max_batch_tokens=8192, max_input_len=4096))
    ids_seen = Counter(r.id for r in c.read_results("hj"))
    assert set(ids_seen) == {f"h{i}" for i in range(300)} and set(ids_seen.values()) == {1}
    assert verify(c.r, name, items=True).ok
    for x in (src, dst, strict.r, c.r):
        x.close()


def test_a_claim_skips_a_shard_whose_slot_is_half_moved(cluster):
    """A worker's claims over a model's shards (conductor/client/shard_claims.py): the first shard in its
    order (the most work waiting) is mid-move, its keys half on each node, so its claims are refused
    (TRYAGAIN, ASK) for as long as the move lasts (seconds for a big slot). The claim takes the next
    shard's batch at once, not after riding that refusal out shard by shard; it tries the refusing shard
    last while it refused lately, answers 'wait' (claim again soon) while it holds the only work, and
    takes its batch once the move ends."""
    from conductor.client.shard_claims import ShardClaims
    from conductor.redis_contract.records import Contract
    from tests.conftest import item
    from tests.helpers import quick

    url, model = cluster.url, "skippy"
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    names = c.shards(model)
    moving, other = names[0], names[1]
    its = [item(f"m{i}", 20, model=model, prefix=("moving",)) for i in range(24)]
    its += [item(f"o{i}", 20, model=model, prefix=("other",)) for i in range(16)]  # two batches
    c.r.hset(K.ModelKeys(model).shard_of, mapping={its[0].sig: 0, its[-1].sig: 1})
    c.submit(its, "sj", seal=True)
    time.sleep(0.1)  # past quiet_ms
    contract = Contract(model=model, max_batch_size=8, max_batch_tokens=8192, max_input_len=4096)
    claims = ShardClaims(Conductor(connect(url)), model)
    assert claims._ordered(claims.names())[0] == moving  # the most tokens waiting: tried first

    slot, frm = S.slot_of(moving), _owner(cluster, moving)
    to = (frm + 1) % 3
    src, dst = (redis.Redis(port=cluster.nodes[i].port) for i in (frm, to))
    try:
        ids = [x.execute_command("CLUSTER", "MYID").decode() for x in (src, dst)]
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[0])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[1])
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        src.execute_command("MIGRATE", "127.0.0.1", cluster.nodes[to].port, "", 0, 5000, "KEYS",
                            *keys[: len(keys) // 2])
        got = []
        t0 = time.monotonic()
        for _ in range(2):  # the other shard's batch each time, its refusing neighbour tried last
            batch, why = claims.claim(contract, "w")
            assert batch is not None and batch.model == other, (why, batch and batch.model)
            got.append(batch)
        took = time.monotonic() - t0
        batch, why = claims.claim(contract, "w")  # only the moving shard's work is left
        assert batch is None and why == "wait", (why, batch and batch.model)
        assert took < 3.0, took  # refused once in ~0.3 s, then last (the cluster client's retries: ~9 s)
        cluster.move_slot(slot, to)  # the rest of its keys, and the slot's new owner on every node
        batch, why = claims.claim(contract, "w")
        assert batch is not None and batch.model == moving, why
        print(f"two claims beside a half-moved shard {took:.2f} s")
    finally:
        for x in (src, dst):
            x.close()


@pytest.fixture(scope="module")
def replicated():
    with EmbeddedCluster(3, replicas=1) as c:
        yield c


@pytest.fixture()
def replicated_once():
    """A cluster of its own: a test that kills a primary leaves that shard without a replica."""
    with EmbeddedCluster(3, replicas=1) as c:
        yield c


def _run_with_failover(
    cluster: EmbeddedCluster, tmp_path, model: str, n: int, how: str, lag_s: float = 0.0
) -> tuple[float, float, dict]:
    """A job of ``n`` items over 3 shards served by two sim worker processes; once a fifth is
    answered, the primary of shard 1 fails over to its replica (``how``: "" planned, "TAKEOVER"
    after the primary is SIGKILLed; ``lag_s``: the replica's link cut that long before, so
    that the primary's last writes never reach it). Waits for the job's end; (seconds until the replica served,
    seconds from the failover to the job's end, the job's status)."""
    url = cluster.url
    c, names = _sharded_job(url, tmp_path, model, n)
    # a short heartbeat: a batch whose claim a lost write left pending is reclaimed within 10 s
    procs = [
        _worker(url, model, f"w{i}", "--sim-time-scale", "2", "--heartbeat-ttl", "1", log=tmp_path) for i in range(2)
    ]
    try:
        _until_a_fifth_answered(c, model, n, procs)
        primary = _owner(cluster, names[1])
        assert primary != 0  # the seed node of the URL stays up
        if lag_s:
            cluster.cut_replication(primary)
            time.sleep(lag_s)
        state = K.ModelKeys(names[1]).state
        before = int(c.r.hget(state, "completed") or 0)
        t0, wall0 = time.monotonic(), time.time()
        if how:
            cluster.nodes[primary].kill()
        took = cluster.failover(primary, how)
        rewound = before - int(c.r.hget(state, "completed") or 0)  # answers the promoted replica lacks
        deadline = time.monotonic() + 120
        while not (st := c.status(model))["done"] and not st.get("lost"):
            assert time.monotonic() < deadline, c.status(model)
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]  # rode it out
            time.sleep(0.1)
        ended = time.monotonic() - t0
    finally:
        for p in procs:
            p.terminate()
        try:
            codes = [p.wait(30) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            codes = [p.wait(30) for p in procs]
            for i in range(2):
                print((tmp_path / f"w{i}.log").read_text()[-3000:])
            raise
    assert codes == [0, 0]
    c.r.close()
    return took, ended, {**st, "rewound": rewound, "at": wall0}


def test_a_planned_failover_mid_run_every_id_once(replicated, tmp_path):
    n, model = 600, "planny"
    took, ended, st = _run_with_failover(replicated, tmp_path, model, n, "")
    url = replicated.url
    rows = [json.loads(x) for x in cli("results", model, url=url).stdout.decode().splitlines()]
    _once(rows, n)
    pause = _longest_pause(rows, st["at"], st["at"] + took)
    print(f"planned failover: promoted in {took:.3f} s, job ended {ended:.1f} s after; longest pause {pause:.2f} s")
    st = json.loads(cli("status", model, "--json", url=url).stdout)
    assert (st["status"], st["completed"]) == ("completed", n), st
    _verified(url, model)


def _verified(url: str, model: str) -> None:
    """Every shard's counters against their data, with the ledger: a promoted replica holds an
    earlier moment of its primary, each script's writes all or none, so nothing may differ."""
    c = Conductor(connect(url))
    for name in c.shards(model):
        rep = verify(c.r, name, items=True)
        assert rep.ok, (name, rep.drift, rep.problems)
    c.r.close()


def _once_or_lost_shown(url: str, model: str, n: int, label: str, took: float, ended: float, st: dict) -> None:
    """After a takeover: no id twice, and every id once or the missing ones counted lost by `status`
    (exit 3), as on one Redis; every shard verified."""
    p = cli("status", model, url=url, check=False)
    doc = json.loads(cli("status", model, "--json", url=url, check=False).stdout)
    rows = [json.loads(x) for x in cli("results", model, url=url).stdout.decode().splitlines()]
    ids = Counter(r["id"] for r in rows)
    print(
        f"{label}: promoted in {took:.3f} s, job ended {ended:.1f} s after; {len(ids)} ids answered, "
        f"lost {doc.get('lost', 0)}, status exit {p.returncode}, {st['rewound']} answers rewound, "
        f"longest pause {_longest_pause(rows, st['at'], st['at'] + took):.2f} s"
    )
    assert not [i for i, k in ids.items() if k > 1]
    if doc.get("lost"):
        assert p.returncode == 3 and "lost" in p.stdout.decode(), p.stdout.decode() + p.stderr.decode()
        assert len(ids) + doc["lost"] >= n
    else:
        _once(rows, n)
        assert (doc["status"], doc["completed"]) == ("completed", n), doc
    _verified(url, model)


@pytest.mark.chaos
@pytest.mark.parametrize("how", ["TAKEOVER", "FORCE"])
def test_a_primary_killed_and_taken_over_mid_run_every_id_once_or_the_loss_shown(replicated_once, tmp_path, how):
    # SIGKILL: writes the replica had not received are gone. Every id answered once, or `status`
    # reports the missing items as lost (exit 3), as on one Redis (tests/test_failover_loss.py);
    # never a job that reads as done with an id unanswered or answered twice. TAKEOVER promotes the
    # replica on its own; FORCE with the other primaries' votes.
    n = 1500
    model = "killy"
    took, ended, st = _run_with_failover(replicated_once, tmp_path, model, n, how)
    _once_or_lost_shown(replicated_once.url, model, n, how.lower(), took, ended, st)


@pytest.mark.chaos
def test_a_primary_killed_while_its_replica_lagged_every_id_once_or_the_loss_shown(replicated_once, tmp_path):
    # The replica's link cut for 1.5 s, then the primary SIGKILLed and the replica taken over: the
    # shard's last 1.5 s of claims and completions are gone. Their batches come back (the lanes
    # as they were, or pending batches no live worker names, reclaimed by the sweep), so the job
    # still ends with every id once; a loss it cannot redo shows in `status`.
    n = 3000
    model = "laggy"
    took, ended, st = _run_with_failover(replicated_once, tmp_path, model, n, "TAKEOVER", lag_s=1.5)
    assert st["rewound"] > 0  # else this test would not test what it says
    _once_or_lost_shown(replicated_once.url, model, n, "lagged takeover", took, ended, st)


@pytest.mark.chaos
def test_items_a_killed_shard_primary_never_replicated_are_shown_lost_then_resubmitted(replicated_once, tmp_path):
    # `conductor submit` declares the file's count on the model's own keys (another slot) before
    # its items go to the shards: a shard's primary that dies with items its replica never got
    # leaves them counted as lost (exit 3), as on one Redis (tests/test_failover_loss.py); the
    # same file again with --resume brings them back, and the job ends with every id once.
    from tests.conftest import follow_with_workers

    cluster, n = replicated_once, 600
    url, model = cluster.url, "lossy"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    c = Conductor(connect(url))
    names = c.shards(model)
    s = next(k for k in (1, 2) if _owner(cluster, names[k]) not in (0, _owner(cluster, model)))
    primary = _owner(cluster, names[s])
    src = tmp_path / "in.jsonl"
    _lines(src, n, model)
    cluster.cut_replication(primary)
    cli("submit", str(src), "--job", model, url=url)
    on_shard = c.status(model)["models"][names[s]]["submitted"]
    assert 0 < on_shard < n
    cluster.nodes[primary].kill()
    cluster.failover(primary, "TAKEOVER")
    p = cli("status", model, url=url, check=False)
    assert p.returncode == 3 and f"lost {on_shard}" in p.stdout.decode(), p.stdout.decode() + p.stderr.decode()
    print(f"a shard's primary killed with {on_shard} of {n} items unreplicated: status exit 3, lost {on_shard}")
    doc = json.loads(cli("status", model, "--json", url=url, check=False).stdout)
    assert (doc["lost"], doc["declared"], doc["submitted"]) == (on_shard, n, n - on_shard), doc
    cli("submit", str(src), "--job", model, "--resume", url=url)
    assert cli("status", model, url=url, check=False).returncode == 0
    rows = follow_with_workers(
        url, model, tmp_path / "out.jsonl", [(model, "w1"), (model, "w2")], batch_size=32, batch_tokens=4096
    )
    _once(rows, n)
    _verified(url, model)
    c.r.close()


def test_a_workers_link_finds_the_replica_that_took_over_from_its_dead_primary(replicated):
    # A worker that lost Redis probes until it answers (workers/outage.py). On a cluster the
    # probe follows the keys to the replica that took over, rather than ping the dead primary
    # for ever (a worker stuck "away" with its model served by the new primary).
    model = "probey"  # its keys in the last third of the slots: nodes[2], which no other test here kills
    r = connect(replicated.url)
    key = K.ModelKeys(model).batches
    assert _owner(replicated, model) == 2
    link = Link(r, key, "w", model)
    replicated.nodes[2].kill()
    assert link.lost(redis.ConnectionError("Connection refused"))
    replicated.failover(2, "TAKEOVER")
    deadline = time.monotonic() + 15
    while not link.probe():
        assert time.monotonic() < deadline, "the probe never found the promoted replica"
        time.sleep(0.05)
    link.up()
    assert r.get_node_from_key(key).port == replicated.nodes[2].port
    r.close()
