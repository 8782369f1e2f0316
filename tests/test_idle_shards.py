"""An idle worker of a model sharded over a three-master Redis Cluster (issue 36; workers/idle.py):
at most about one command a second (a BLPOP on the model's doorbell, a beat of the model's keys and
one of a shard's, in turn, each 5 s), woken at once by work submitted to any shard, and never taken for
dead on a shard between its turns there. The figures are bench/RESULTS.md's
(bench/broker/idle_fleet.py --sharded); these tests count, with margins."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from bench.common import sent
from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedCluster
from conductor.redis_contract import keys as K
from conductor.workers.engines.sim import SimEngine
from conductor.workers.worker import Worker, WorkerOptions
from tests.conftest import item
from tests.helpers import quick
from tests.worker_kit import stop_fleet


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(3) as c:
        yield c


def _fleet(
    url: str, model: str, n: int, ttl_s: float = 10.0, time_scale: float = 0.0
) -> tuple[list[Worker], list[threading.Thread]]:
    workers = [
        Worker(
            Conductor(connect(url)),
            SimEngine(model, max_batch_size=8, max_batch_tokens=8192, time_scale=time_scale),
            WorkerOptions(name=f"i{i}", heartbeat_ttl_s=ttl_s),
        )
        for i in range(n)
    ]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()
    return workers, threads


def _node_calls(cluster: EmbeddedCluster, *names: str) -> int:
    """Calls of these commands (cmdstat_<name>) the cluster's nodes counted since their resetstat."""
    import redis

    total = 0
    for node in cluster.nodes:
        r = redis.Redis(port=node.port)
        stats = r.info("commandstats")
        total += sum(int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in names)
        r.close()
    return total


def _resetstat(cluster: EmbeddedCluster) -> None:
    import redis

    for node in cluster.nodes:
        r = redis.Redis(port=node.port)
        r.config_resetstat()
        r.close()


def test_an_idle_worker_on_three_shards_sends_under_one_command_a_second_and_wakes_for_shard_2(cluster):
    url, model = cluster.url, "idly"
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    shards = c.shards(model)
    assert len(shards) == 3 and model not in shards
    # every maintenance lease (the model's, each shard's) held elsewhere: each worker is one that
    # beats and waits, none sweeps (a holder's sweep costs more: bench/RESULTS.md gives it apart)
    for name in (model, *shards):
        c.ensure_model(name)
        c.r.set(K.ModelKeys(name).maint_lease, "elsewhere", px=120_000)
    # a batch runs about 1.5 s (sim, time scale 2, 128 tokens): long enough to read its holder's heartbeats
    workers, threads = _fleet(url, model, 3, time_scale=2.0)
    try:
        deadline = time.monotonic() + 30
        # each through a beat of a shard: its heartbeat there outlives the TTL (a round of the keyspaces)
        while not all(
            w.last_claim == "idle" and any((c.r.pttl(K.ModelKeys(n).heartbeat(w.name)) or 0) > 10_500 for n in shards)
            for w in workers
        ):
            assert time.monotonic() < deadline, "the fleet did not go idle"
            time.sleep(0.1)
        sent.install()
        try:
            sent.reset()
            _resetstat(cluster)
            t0 = time.monotonic()
            time.sleep(8.0)
            took = time.monotonic() - t0
            per = {w.name: sent.of(w.c.r) / took for w in workers}
            # what the nodes counted of what clients send: the beats and the BLPOPs (the claim's and
            # the sweep's commands would show as XINFO, LRANGE or a third script call a period)
            node_calls = _node_calls(cluster, "evalsha", "blpop", "lpush", "xinfo", "hget", "hkeys") / took
        finally:
            sent.uninstall()
        assert all(0.1 < v <= 1.0 for v in per.values()), per  # 0.6 a second: 3 commands each 5 s
        assert node_calls <= 1.0 * len(workers) + 0.5, (node_calls, per)
        for w in workers:
            for name in (model, *shards):
                mk = K.ModelKeys(name)
                assert c.r.pttl(mk.heartbeat(w.name)) > 0 and c.r.hexists(mk.workers, w.name), (w.name, name)

        # work submitted to the last shard rings the model's doorbell: a worker wakes and serves it
        # within a few seconds, far under its next turn on that shard (a round: 20 s)
        it = item("late", 10, model=model, prefix=("shard 2",), max_tokens=128)
        c.r.hset(K.ModelKeys(model).shard_of, it.sig, 2)
        rings = sum(w.idle.bell.rings for w in workers if w.idle is not None)
        held = K.ModelKeys(shards[2]).batches
        s, us = c.r.time()
        c.submit([it], "j")
        deadline = time.monotonic() + 15
        # woken for work, its heartbeats are back to the TTL's own on every keyspace while it holds the
        # batch: had it died with it, the batch would come back a TTL after, not a round after
        # (IdleBeat._unstretch). Read while the batch is pending (before and after the reads), not once
        # it is done: its next idle beat stretches a shard's heartbeat to a round again.
        seen: list[tuple[str, dict[str, int]]] = []
        while not (rows := c.read_results("j")):
            assert time.monotonic() < deadline, "work on shard 2 did not wake an idle worker"
            if pending := c.r.xpending_range(held, K.GROUP, "-", "+", 1):
                holder = pending[0]["consumer"].decode()
                ttls = {n: c.r.pttl(K.ModelKeys(n).heartbeat(holder)) for n in (model, *shards)}
                if c.r.xpending_range(held, K.GROUP, "-", "+", 1, consumername=holder):
                    seen.append((holder, ttls))
            time.sleep(0.02)
        assert rows[0].model == model and c.status("j")["models"][shards[2]]["submitted"] == 1
        assert rows[0].claimed_at - (s * 1000 + us / 1000) < 2500, rows[0]
        assert sum(w.idle.bell.rings for w in workers if w.idle is not None) > rings
        served = next(w for w in workers if w.name == rows[0].worker)
        assert served.idle is not None
        assert seen and {h for h, _ in seen} == {served.name}, seen
        for _, ttls in seen:
            assert all(0 < v <= served.idle.ttl_ms for v in ttls.values()), ttls
    finally:
        stop_fleet(workers, threads)


def _parts(w: Worker) -> dict:
    """The maintenance parts (the model's, each shard's) of an idle worker."""
    assert w.idle is not None
    return w.idle.maint.parts  # type: ignore[attr-defined]


def test_the_idle_holder_of_every_part_sends_about_one_command_a_second(cluster, monkeypatch):
    """One idle worker of a model over three shards holds every part's lease (the model's, each
    shard's): with nothing in flight it sends a BLPOP and two beats a period (the model's keys, a
    shard's in turn) and the model's two global reads every second period, its shards swept with their
    turns: 4 commands a period, 0.8 a second at the default TTL (2 at this 4 s TTL), where its sweeps
    of every part sent over 5 a second."""
    from conductor.workers import maintenance
    monkeypatch.setattr(maintenance, "FULL_SWEEP_S", 3.0)  # every part's first full sweep sooner (10 s)
    url, model, ttl = cluster.url, "holdy", 4.0
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    names = [model, *c.shards(model)]
    workers, threads = _fleet(url, model, 1, ttl_s=ttl)
    try:
        deadline = time.monotonic() + 30
        while not (workers[0].last_claim == "idle"
                   and all(c.r.get(K.ModelKeys(n).maint_lease) == b"i0" for n in names)):
            assert time.monotonic() < deadline, "the worker did not go idle holding every lease"
            time.sleep(0.1)
        # past every part's first full sweep (at its turn), which a quiet part runs once: its next is
        # QUIET_FULL_SWEEP_S away (about 10 s at this TTL; a loaded machine's turns come later)
        while not (set(_parts(workers[0])) == set(names)
                   and all(p._full_next - time.monotonic() > maintenance.QUIET_FULL_SWEEP_S / 2
                           for p in _parts(workers[0]).values())):
            assert time.monotonic() < deadline + 30, "the quiet parts' full sweeps did not run"
            time.sleep(0.1)
        rate = sent.rates({"i0": workers[0].c.r}, 12.0)["i0"]
        assert all(c.r.get(K.ModelKeys(n).maint_lease) == b"i0" for n in names)  # kept by its beats
        assert 0.5 < rate <= 2.5, rate  # a period is 2 s: 4 commands a period are 2 a second
    finally:
        stop_fleet(workers, threads)


def test_a_batch_claimed_on_a_quiet_shard_comes_back_within_a_period_and_a_sweep(cluster):
    """The idle holder of every part sweeps a quiet shard only with its turn (a round: 15 s at S = 3),
    but a worker holding batches on a shard sets the model's holding mark with its heartbeat
    (lua/heartbeat.lua), which the holder's next beat of the model's keys reads: from then it sweeps
    its shards every half period, so a dead worker's batch on the shard just beaten comes back within a
    period and a sweep of its death, not at that shard's next turn. At a 4 s TTL: a period 2 s, a
    round 6 s."""
    from conductor.redis_contract import script_calls as calls
    from conductor.redis_contract.records import Contract

    url, model = cluster.url, "quietly"
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    shards = c.shards(model)
    workers, threads = _fleet(url, model, 1, ttl_s=4.0)
    try:
        deadline = time.monotonic() + 30
        while not (workers[0].last_claim == "idle"
                   and all(c.r.get(K.ModelKeys(n).maint_lease) == b"i0" for n in (model, *shards))):
            assert time.monotonic() < deadline, "the worker did not go idle holding every lease"
            time.sleep(0.1)
        time.sleep(7.0)  # through a round of turns: every shard's part quiet
        # the shard whose turn came last: its next is a round away
        last = max(shards, key=lambda n: c.r.pttl(K.ModelKeys(n).heartbeat("i0")) or 0)
        it = item("ghosty", 10, model=model, prefix=("shard",))
        c.r.hset(K.ModelKeys(model).shard_of, it.sig, shards.index(last))

        class RingTakenElsewhere(Conductor):
            def ring_model_bell(self, models: object) -> None:
                """Another idle worker took the ring (the holder is not the one a ring wakes)."""

        RingTakenElsewhere(c.r).submit([it], "j")
        batch, why = c.claim(Contract(model=last, max_batch_size=8, max_batch_tokens=4096, max_input_len=4096),
                             "ghost")
        assert batch is not None, why
        # the ghost's heartbeat on the model's keys, as a worker's holding a batch sets it, then its death
        calls.heartbeat(K.ModelKeys(model), "ghost", int(time.time() * 1000), 10_000, [batch.batch_id], 0,
                        holding=True).run(c.scripts)
        c.r.delete(K.ModelKeys(model).heartbeat("ghost"), K.ModelKeys(last).heartbeat("ghost"))
        died = time.monotonic()
        while c.r.xpending(K.ModelKeys(last).batches, K.GROUP)["pending"]:
            assert time.monotonic() - died < 4.5, "the dead worker's batch waited for the shard's turn"
            time.sleep(0.05)
        print(f"back {time.monotonic() - died:.2f} s after its worker died (a round: 6 s)")
    finally:
        stop_fleet(workers, threads)


def _watch(
    c: Conductor, names: list[str], workers: list[Worker], seconds: float, until: Callable[[], bool] = lambda: True
) -> None:
    """For ``seconds`` (and then until ``until()``): every worker's heartbeat and registration on the
    model and every shard, read every 0.1 s."""
    end = time.monotonic() + seconds
    while time.monotonic() < end or not until():
        assert time.monotonic() < end + 60, "gave up waiting"
        for name in names:
            mk = K.ModelKeys(name)
            pipe = c.r.pipeline(transaction=False)
            for w in workers:
                pipe.exists(mk.heartbeat(w.name))
                pipe.hexists(mk.workers, w.name)
            got = pipe.execute()
            assert all(got), (name, [w.name for w in workers], got)
        time.sleep(0.1)


def test_idle_workers_stay_alive_and_registered_on_every_shard_idle_busy_and_idle_again(cluster):
    """A 2 s heartbeat TTL: a beat a second (the model's keys each time), each shard's turn every 3 s, its
    heartbeat there 3.9 s.
    The shards' lease holders sweep meanwhile (each worker a consumer of each shard's group, as one
    is once it has claimed there): a heartbeat that lapsed would cost the worker its registration.
    From the first idle beat (the heartbeat thread's beats before it left each shard the TTL to live),
    through a busy spell longer than a beat (the thread beats again) and idle again."""
    url, model = cluster.url, "lively"
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    names = [model, *c.shards(model)]
    workers, threads = _fleet(url, model, 3, ttl_s=2.0, time_scale=4.0)
    try:
        deadline = time.monotonic() + 30
        while not all(w.last_claim == "idle" and w.idle is not None and w.idle.beats >= 1 for w in workers):
            assert time.monotonic() < deadline, "the fleet did not go idle"
            time.sleep(0.1)
        for name in names:
            for w in workers:
                c.r.xgroup_createconsumer(K.ModelKeys(name).batches, K.GROUP, w.name)
        beats = {w.name: w.idle.shard_beats for w in workers if w.idle is not None}
        _watch(c, names, workers, 4.0)
        # work on every shard: each batch runs 0.8 to 3 s (sim, time scale 4), past a beat period
        its = [
            item(f"b{s}.{k}", 10, model=model, prefix=(f"shard {s}",), max_tokens=128)
            for s in range(3)
            for k in range(3)
        ]
        c.r.hset(K.ModelKeys(model).shard_of, mapping={it.sig: int(it.id[1]) for it in its})
        c.submit(its, "busy", seal=True)
        _watch(c, names, workers, 0.0, until=lambda: len(c.read_results("busy")) == 9)
        _watch(c, names, workers, 5.0)
        assert all(w.idle is not None and w.idle.shard_beats - beats[w.name] >= 4 for w in workers), beats
        assert all(w.last_claim == "idle" for w in workers)
        holders = {(c.r.get(K.ModelKeys(n).maint_lease) or b"").decode() for n in names}
        assert holders <= {w.name for w in workers}, holders
        assert {r.worker for r in c.read_results("busy")} and c.status("busy")["done"]
    finally:
        stop_fleet(workers, threads)


def test_a_worker_killed_while_idle_is_dead_on_every_shard_a_ttl_after(cluster):
    """A 2 s TTL, three shards: an idle worker's shard heartbeats live a round of the shards (3.9 s),
    but it counts as alive on a shard only while its heartbeat on the model's own keys, beaten every
    period with the TTL's own, lives too: SIGKILLed while idle, it is dead everywhere within the TTL
    (plus the reads' margin), not a round (it was up to 5.2 s here, 26 s at S = 3 and the default TTL).
    A shard's sweep then takes it for dead there at once: its registration and consumer forgotten."""
    import os
    import signal
    import subprocess
    import sys

    from conductor.client.fleet import live_workers
    from tests.conftest import ROOT

    url, model, ttl = cluster.url, "lapsy", 2.0
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    names = [model, *c.shards(model)]
    w = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                          "--model", model, "--name", "lap", "--heartbeat-ttl", str(ttl)],
                         env=dict(os.environ, CONDUCTOR_REDIS_URL=url), cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 30
        # idle, through its turns: a shard heartbeat that outlives the TTL by over half of it
        while max((c.r.pttl(K.ModelKeys(n).heartbeat("lap")) or 0) for n in names[1:]) < 1500 * ttl:
            assert time.monotonic() < deadline and w.poll() is None, "the worker did not go idle"
            time.sleep(0.05)
        for n in names[1:]:
            c.r.xgroup_createconsumer(K.ModelKeys(n).batches, K.GROUP, "lap")
        w.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        w.wait(10)
        while any("lap" in live_workers(c.r, n) for n in names):
            assert time.monotonic() - killed < 10, {n: live_workers(c.r, n) for n in names}
            time.sleep(0.02)
        lapse = time.monotonic() - killed
        longest = max((c.r.pttl(K.ModelKeys(n).heartbeat("lap")) or 0) for n in names[1:])
        assert lapse <= ttl + 0.7 and longest > 0, (lapse, longest)  # a shard heartbeat still runs
        for n in names[1:]:
            c.reclaim_dead(n)
            mk = K.ModelKeys(n)
            assert not c.r.hexists(mk.workers, "lap") and not c.r.exists(mk.heartbeat("lap")), n
            assert "lap" not in {row["name"] for row in c.consumers(n)}, n
        print(f"lapse {lapse:.2f} s after SIGKILL (TTL {ttl} s, 3 shards)")
    finally:
        if w.poll() is None:
            w.kill()
            w.wait(10)


# claim.lua's fleet size on a keyspace (lua/lib_workers.lua ``fleet_size``: the live workers a fair share and
# the rebalance count), for a caller named '' that is none of them
_FLEET_PROBE = "--@include lib_workers.lua\nreturn fleet_size({base = KEYS[1], consumer = ''}) - 1\n"


def _fleet_size(c: Conductor, name: str) -> int:
    from conductor.redis_contract import scripts

    text = scripts.expand("fleet_probe.lua", lambda f: _FLEET_PROBE if f == "fleet_probe.lua" else scripts._read(f))
    return int(c.r.eval(text, 1, K.ModelKeys(name).base))  # type: ignore[arg-type]


def test_a_worker_killed_while_idle_leaves_each_shards_fleet_size_about_a_ttl_after(cluster):
    """What a shard's claims count (claim.lua's fleet size) reads only the shard's heartbeats, and an idle
    worker's lives a round of the shards (3.9 periods at S = 3): the model's idle lease holder, told by
    its beat who lapsed on the model's keys (lua/idle_beat.lua, M:beats), deletes theirs. A worker
    SIGKILLed just after its turn leaves every shard's fleet size a TTL and at most a period after its
    last beat, before its freshest shard heartbeat would have run out (it counted there until then: 19.5 s
    at S = 3 and the default TTL). A 4 s TTL: a period 2 s, a shard heartbeat 7.8 s."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    url, model, ttl = cluster.url, "killy", 4.0
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    names = [model, *c.shards(model)]
    workers, threads = _fleet(url, model, 1, ttl_s=ttl)  # the holder, idle, alive throughout
    w = None
    try:
        deadline = time.monotonic() + 30
        while not (workers[0].last_claim == "idle" and c.r.get(K.ModelKeys(model).maint_lease) == b"i0"):
            assert time.monotonic() < deadline, "the holder did not go idle holding the model's lease"
            time.sleep(0.1)
        w = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine",
                              "sim", "--model", model, "--name", "lap", "--heartbeat-ttl", str(ttl)],
                             env=dict(os.environ, CONDUCTOR_REDIS_URL=url), cwd=str(ROOT))
        # idle, just past a turn: its freshest shard heartbeat lives over 1.7 TTLs
        while not (c.r.zscore(K.ModelKeys(model).beats, "lap")
                   and max((c.r.pttl(K.ModelKeys(n).heartbeat("lap")) or 0) for n in names[1:]) > 1700 * ttl):
            assert time.monotonic() < deadline + 30 and w.poll() is None, "the worker did not go idle"
            time.sleep(0.02)
        assert all(_fleet_size(c, n) == 2 for n in names[1:])
        w.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        runs = {n: (c.r.pttl(K.ModelKeys(n).heartbeat("lap")) or 0) / 1000 for n in names[1:]}
        w.wait(10)
        while any(_fleet_size(c, n) != 1 for n in names[1:]):
            assert time.monotonic() - killed < 3 * ttl, runs
            time.sleep(0.05)
        lapse = time.monotonic() - killed
        # deleted, not run out: before the freshest would have (a period and a grace apart at worst)
        assert lapse < max(runs.values()), (lapse, runs)
        assert lapse <= 1.5 * ttl + 1.0, (lapse, runs)  # a TTL and a period after its last beat, and margin
        assert not c.r.zscore(K.ModelKeys(model).beats, "lap")
        # and forgotten everywhere (registration, consumer), not left to a quiet part's hourly full sweep
        while any(c.r.hexists(K.ModelKeys(n).workers, "lap") for n in names):
            assert time.monotonic() - killed < lapse + 2.0, "registered still"
            time.sleep(0.05)
        assert workers[0].last_claim == "idle"
        print(f"out of every shard's fleet {lapse:.2f} s after SIGKILL (TTL {ttl} s; its shard heartbeats "
              f"had {max(runs.values()):.2f} s to run)")
    finally:
        if w is not None and w.poll() is None:
            w.kill()
            w.wait(10)
        stop_fleet(workers, threads)


def test_a_shards_sweep_reads_one_xpending_while_nothing_is_in_flight_there(cluster):
    """S + 1 maintenance parts (the model's, each shard's), each with its own lease holder: a shard's
    tick with nothing in flight renews its lease and reads one XPENDING; its trim and finished shapes
    wait for the full sweep, and the global duties (expiry, intake tasks) are the model's part's. With
    a batch in flight there, it sweeps it all (the dead consumer's batch comes back)."""
    from conductor.client.shard_claims import ShardClaims
    from conductor.redis_contract.records import Contract
    from conductor.workers import shard_maintenance

    url, model = cluster.url, "sweepy"
    c = Conductor(connect(url))
    quick(c, model, shards=3)
    shards = c.shards(model)
    for name in (model, *shards):
        c.ensure_model(name)
    sm = shard_maintenance.for_worker(c, ShardClaims(c, model), "holder", 10.0)
    for m in sm.parts.values():
        m.verify_interval_s = 0
    sm.tick()  # the first: every part's lease and full sweep

    def one_tick(name: str) -> tuple[int, dict[str, int] | None]:
        part = sm.parts[name]
        part._next = 0.0  # due now (a shard's period is 2.5 s)
        sent.install()
        try:
            sent.reset()
            got = part.tick()
            return sent.of(c.r), got
        finally:
            sent.uninstall()

    for name in shards:
        assert one_tick(name)[0] <= 2, name  # lease.lua and XPENDING (it was 7: trim, XRANGE, expiry...)
    it = item("fly", 10, model=model, prefix=("shard 0",))
    c.r.hset(K.ModelKeys(model).shard_of, it.sig, 0)
    c.submit([it], "j", seal=True)
    batch, why = c.claim(Contract(model=shards[0], max_batch_size=8, max_batch_tokens=4096, max_input_len=4096),
                         "gone")
    assert batch is not None, why
    n, got = one_tick(shards[0])
    assert got is not None and got["batches"] == 1 and n > 4, (n, got)  # reclaimed, trimmed, alarm read
