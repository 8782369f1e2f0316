"""Shape lifecycle (seed 003): staged, active, draining, finished, warming; aging; lane hygiene."""

import threading
import time

import redis

from conductor.formats.signature import shape_signature
from tests.conftest import item
from tests.helpers import MK, contract, drain, results_for


def inst(prefix, ep=1):
    return f"{shape_signature([prefix])}:{ep}"


def state(c, key):
    v = c.r.hget(MK.inst(key), "state")
    return v.decode() if v else None


def setup(c, **extra):
    cfg = {"budget_tokens": 800, "budget_items": 8, "release_batches": 0, "activate_batches": 2,
           "quiet_ms": 60000, "drain_batches": 1, "prewarm_batches": 2, "aging_ms": 0,
           "hygiene_idle_ms": 60000}
    cfg.update(extra)
    c.set_config("m", cfg)


def test_staged_until_activation_threshold_then_active(cdr):
    setup(cdr)
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(7)], "j")  # 700: not one full batch
    assert cdr.claim(contract(8, 800), "w") == (None, "wait")
    assert state(cdr, inst("A")) == "staged"
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(7, 17)], "j")  # 1700 >= 2 x 800
    b, _ = cdr.claim(contract(8, 800), "w")
    assert b is not None and state(cdr, inst("A")) == "active"
    assert cdr.r.hget(MK.inst(inst("A")), "activated_by") == b"threshold"


def test_a_worker_with_nothing_else_activates_a_staged_shape_holding_a_full_batch(cdr):
    setup(cdr, activate_batches=4)
    cdr.submit([item(f"a{i}", 96, prefix=("A",)) for i in range(9)], "j")  # 864: one batch, < 4 x 800
    b, _ = cdr.claim(contract(8, 800), "w")  # rather than idle until intake goes quiet
    assert b is not None and len(b.items) == 8 and state(cdr, inst("A")) == "active"
    assert cdr.r.hget(MK.inst(inst("A")), "activated_by") == b"depth"


def test_active_shape_merges_new_items_into_existing_lanes(cdr):
    setup(cdr, activate_batches=0)
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(20)], "j")
    b, _ = cdr.claim(contract(8, 800), "w")
    lanes_before = cdr.r.zrange(MK.inst_lanes(inst("A")), 0, -1)
    cdr.submit([item(f"late{i}", 100, prefix=("A",)) for i in range(8)], "j")
    assert cdr.r.zrange(MK.inst_lanes(inst("A")), 0, -1) == lanes_before
    assert int(cdr.r.hget(MK.shape(shape_signature(["A"])), "epoch")) == 1  # no fresh shape record
    rest = drain(cdr, contract(8, 800))
    assert {x.epoch for x in rest} == {1}
    assert sum(len(x.items) for x in rest) + len(b.items) == 28


def test_finished_instance_returns_every_lane(cdr):
    setup(cdr, activate_batches=0, drain_batches=100)
    cdr.submit([item(f"a{i}", 20 + 150 * (i % 4), prefix=("A",)) for i in range(16)], "j")
    assert cdr.r.zcard(MK.inst_lanes(inst("A"))) == 4
    drain(cdr, contract(8, 100000))
    assert not cdr.r.exists(MK.inst(inst("A")), MK.inst_lanes(inst("A")), MK.inst_fill(inst("A")))
    assert list(cdr.r.scan_iter(f"{MK.base}:lane*")) == []
    fin = cdr.r.xrange(MK.finished)
    assert [f[b"inst"].decode() for _, f in fin] == [inst("A")]


def test_warming_signal_then_switch_to_the_warmed_shape(cdr):
    setup(cdr, activate_batches=1, prewarm_batches=2, drain_batches=1)
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(40)], "j")   # 4000 tokens
    cdr.submit([item(f"b{i}", 100, prefix=("B",)) for i in range(12)], "j")   # 1200: above activation
    cdr.submit([item(f"c{i}", 100, prefix=("C",)) for i in range(9)], "j")    # 900: above, fewer tokens
    seen = []
    warming = set()
    while True:
        b, why = cdr.claim(contract(8, 800), "w")
        if b is None:
            break
        seen.append(b.prefix[0])
        if b.warming:
            warming.add(b.warming)
        cdr.complete(b, results_for(b))
    assert inst("B") in warming  # the pre-warm signal named B while A ran
    assert seen.index("B") > max(i for i, s in enumerate(seen) if s == "A")
    assert cdr.r.hget(MK.state, "warmings") is not None
    assert seen == sorted(seen, key=["A", "B", "C"].index)  # A, then the warmed B, then C


def test_worker_prewarms_the_sim_engine_graphs(cdr):
    from conductor.workers.engines.sim import SimEngine
    from conductor.workers.worker import Worker, WorkerOptions
    setup(cdr, activate_batches=1, prewarm_batches=2)
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(40)], "j")
    cdr.submit([item(f"b{i}", 100, prefix=("B",)) for i in range(24)], "j")
    eng = SimEngine("m", max_batch_size=8, max_batch_tokens=800)
    w = Worker(cdr, eng, WorkerOptions(name="w1"))
    w.register()
    for _ in range(2000):
        if not w.turn() and cdr.status("j")["pending"] == 0:
            break
    assert cdr.status("j")["pending"] == 0
    assert eng.counters.graphs_prewarmed >= 1
    # B's lane (padded length 104) was built ahead: only A's graph was a rebuild
    assert eng.counters.graph_rebuilds == 1


def test_draining_instance_never_takes_a_new_item_under_concurrency(cdr):  # noqa: C901 - one scenario, threads inline
    # an instance without a full lane drains under 10 budgets: frequent drains while producers write
    setup(cdr, activate_batches=0, drain_batches=10, prewarm_batches=0)
    stop = threading.Event()
    made_at: dict[str, int] = {}
    drained_at: dict[str, int] = {}
    n_prod = 4
    per = 300

    def producer(p):
        from conductor.client import Conductor, connect
        c = Conductor(connect(_url(cdr)))
        for k in range(0, per, 10):
            # when the item was made: one made after its instance began draining cannot have
            # arrived before it
            made = int(time.time() * 1000)
            its = [item(f"p{p}-{k + i}", 50 + (k % 7) * 10, prefix=("S",)) for i in range(10)]
            for it in its:
                made_at[it.id] = made
            c.submit(its, "j")
            time.sleep(0.02)

    def consumer(name):
        from conductor.client import Conductor, connect
        c = Conductor(connect(_url(cdr)))
        while not stop.is_set():
            b, _ = c.claim(contract(8, 800), name)
            if b is None:
                time.sleep(0.001)
                continue
            c.complete(b, results_for(b, name))

    def checker():
        # the moment each instance began draining, as seen while it drains
        from conductor.client import connect
        r = connect(_url(cdr))
        while not stop.is_set():
            for key in r.scan_iter(f"{MK.base}:inst:*", count=1000):
                k = key.decode()
                if k.count(":") != 4:
                    continue
                h = r.hgetall(key)
                if h.get(b"state") == b"draining":
                    drained_at[k.split(":inst:")[1]] = int(h[b"draining_ms"])

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(n_prod)]
    threads += [threading.Thread(target=consumer, args=(f"w{i}",)) for i in range(2)]
    threads.append(threading.Thread(target=checker))
    for t in threads:
        t.start()
    for t in threads[:n_prod]:
        t.join()
    deadline = time.monotonic() + 30
    cdr.set_config("m", {"quiet_ms": 50})
    while cdr.status("j")["pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads[n_prod:]:
        t.join()
    res = cdr.read_results("j")
    assert len(res) == n_prod * per == len({r.id for r in res})
    assert len(drained_at) > 3  # the checker saw drains
    late = [(r.id, f"{r.shape}:{r.epoch}") for r in res
            if made_at[r.id] > drained_at.get(f"{r.shape}:{r.epoch}", 1 << 62)]
    assert late == []  # no item made after its instance began draining was served from it
    assert len({r.epoch for r in res}) > 1  # drains happened while producers were writing


def _url(c):
    kw = c.r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def test_aging_bounds_the_wait_of_a_small_shape(cdr):
    setup(cdr, activate_batches=1, aging_ms=400, drain_batches=0)
    stop = threading.Event()

    def feed_popular():
        from conductor.client import Conductor, connect
        c = Conductor(connect(_url(cdr)))
        k = 0
        while not stop.is_set():
            c.submit([item(f"a{k + i}", 100, prefix=("A",)) for i in range(8)], "j")
            k += 8
            time.sleep(0.01)

    t = threading.Thread(target=feed_popular)
    t.start()
    try:
        time.sleep(0.1)
        cdr.submit([item("small", 100, prefix=("B",))], "j")  # far below any activation threshold
        t0 = time.monotonic()
        waited = None
        while time.monotonic() - t0 < 5:
            b, _ = cdr.claim(contract(8, 800), "w")
            if b is None:
                time.sleep(0.005)
                continue
            cdr.complete(b, results_for(b))
            if b.prefix == ["B"]:
                waited = time.monotonic() - t0
                break
    finally:
        stop.set()
        t.join()
    assert waited is not None, "the small shape starved"
    assert waited < 0.4 + 0.5  # aging_ms plus scheduling slack
    assert int(cdr.r.hget(MK.state, "preemptions")) >= 1


def test_lane_hygiene_force_drains_a_small_idle_lane(cdr):
    setup(cdr, activate_batches=0, hygiene_idle_ms=150, drain_batches=0)
    cdr.set_config("m", {"lane_floor": 0, "lane_thr_min": 0.01, "lane_thr_max": 0.01})
    cdr.submit([item(f"odd{i}", 300, prefix=("A",)) for i in range(2)], "j")  # a small lane, never ready
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(16)], "j")
    b, _ = cdr.claim(contract(8, 800), "w")
    assert not b.hygiene and b.items[0].input_tokens == 100
    time.sleep(0.2)
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(16, 40)], "j")  # the busy lane keeps going
    got = []
    for _ in range(3):
        b, _ = cdr.claim(contract(8, 800), "w")
        got.append(b)
    hyg = [x for x in got if x.hygiene]
    assert len(hyg) == 1 and {i.id for i in hyg[0].items} == {"odd0", "odd1"}
    assert int(cdr.r.hget(MK.state, "hygiene_drains")) == 1


def test_thrash_alarm_counts_short_shapes(cdr, caplog):
    from conductor.observability import metrics
    from conductor.workers.maintenance import Maintenance
    setup(cdr, activate_batches=0, drain_batches=100)
    m = Maintenance(cdr, "m", "w", interval_s=0)
    m.tick()  # positions the cursor
    for s in "XYZ":
        cdr.submit([item(f"{s}{i}", 100, prefix=(s,)) for i in range(10)], "j")
    before = metrics.THRASHING_SHAPES.labels("m", "w")._value.get()
    # 1,000 tokens each could fill 2 batches of 800; batches of 2 items run each in 5
    drain(cdr, contract(2, 800))
    import logging
    with caplog.at_level(logging.CRITICAL, logger="conductor.maintenance"):
        m._next = 0
        m.tick()
    assert metrics.THRASHING_SHAPES.labels("m", "w")._value.get() - before == 3
    assert m.batches_per_shape == [5, 5, 5]
    assert sum("shape_thrashing" in r.message for r in caplog.records) == 3


def test_a_small_shape_run_in_the_batches_it_could_fill_is_not_thrashing(cdr, caplog):
    from conductor.observability import metrics
    from conductor.workers.maintenance import Maintenance
    setup(cdr, activate_batches=0, drain_batches=100)
    m = Maintenance(cdr, "m", "w", interval_s=0)
    m.tick()
    for s in "XYZ":
        cdr.submit([item(f"{s}{i}", 96, prefix=(s,)) for i in range(10)], "j")
    before = metrics.THRASHING_SHAPES.labels("m", "w")._value.get()
    drain(cdr, contract(8, 800))  # 8 + 2 items: the 2 batches its 960 tokens could fill
    m._next = 0
    m.tick()
    assert m.batches_per_shape == [2, 2, 2]
    assert metrics.THRASHING_SHAPES.labels("m", "w")._value.get() == before


def test_drain_threshold_is_exact(cdr):
    # budget 800: drain under 2 budgets = 1600 tokens when no lane holds a full batch
    setup(cdr, activate_batches=0, drain_batches=2)
    cdr.set_config("m", {"lane_floor": 0, "lane_thr_min": 0.01, "lane_thr_max": 0.01})
    # eight lanes of two items each (at most 2 x 312 padded < 800): no lane ready, 3280 tokens;
    # a worker taking 64 items cannot fill a batch from the neighbours either
    cdr.submit([item(f"a{i}", 100 + 30 * (i % 8)) for i in range(16)], "j")
    tokens = int(cdr.r.hget(MK.intake, "tokens"))
    assert tokens >= 1600
    assert cdr.claim(contract(64, 100000), "w") == (None, "wait")
    assert state(cdr, inst("sys")) == "active"
    cdr.set_config("m", {"drain_batches": tokens // 800 + 1})  # now pending < threshold
    b, _ = cdr.claim(contract(64, 100000), "w")
    assert b is not None and state(cdr, inst("sys")) == "draining"
    assert len(b.items) == 16  # what is left goes as one batch


def test_only_one_shape_warms_at_a_time(cdr):
    setup(cdr, activate_batches=1, prewarm_batches=100)
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(40)], "j")
    for s in "BCD":
        cdr.submit([item(f"{s}{i}", 100, prefix=(s,)) for i in range(10)], "j")
    for _ in range(3):
        b, _ = cdr.claim(contract(8, 800), "w")
        assert b.prefix == ["A"]
    states = [state(cdr, inst(s)) for s in "BCD"]
    assert states.count("warming") == 1 and states.count("staged") == 2
    assert int(cdr.r.hget(MK.state, "warmings")) == 1


def test_quiet_lane_ids_are_reused(cdr):
    setup(cdr, activate_batches=0, drain_batches=0, hygiene_idle_ms=60000)
    cdr.set_config("m", {"lane_quiet_ms": 0, "lane_floor": 0, "lane_thr_min": 0.01, "lane_thr_max": 0.01})
    cdr.submit([item(f"a{i}", 100) for i in range(8)] + [item(f"b{i}", 500) for i in range(8)], "j")
    ids = {int(x) for x in cdr.r.zrange(MK.inst_lanes(inst("sys")), 0, -1)}
    assert ids == {0, 1}
    b, _ = cdr.claim(contract(8, 100000), "w")  # empties one lane; quiet at once: its id returns
    freed = int(b.lane)
    assert cdr.r.smembers(MK.inst_free(inst("sys"))) == {str(freed).encode()}
    cdr.submit([item("c0", 2000)], "j")  # a new lane takes the freed id, not a new one
    assert {int(x) for x in cdr.r.zrange(MK.inst_lanes(inst("sys")), 0, -1)} == {0, 1}
    assert int(cdr.r.hget(MK.inst(inst("sys")), "lane_seq")) == 2


def _script_commands(c, url, call):
    """The commands Lua ran while ``call()`` ran (MONITOR), each as its words."""
    out, ready = [], threading.Event()
    mon = redis.Redis.from_url(url)

    def watch():
        with mon.monitor() as m:
            ready.set()
            for cmd in m.listen():
                if cmd["command"] == "ECHO test-lifecycle-end":
                    return
                if cmd.get("client_type") == "lua":
                    out.append(cmd["command"].split())

    t = threading.Thread(target=watch)
    t.start()
    ready.wait()
    time.sleep(0.05)
    got = call()
    c.r.echo("test-lifecycle-end")
    t.join(5)
    return got, out


def test_a_claim_that_switches_and_prewarms_reads_each_staged_shape_once(cdr, redis_url):
    # The claim that starts A weighs the staged shapes twice: pick_next's survey, then the pre-warm
    # pick (top_staged); B, C and D were read by HMGET twice each before their fields were kept for
    # the call (lib_survey.lua staged_fields); the warming B is written, so what follows reads it again.
    setup(cdr, activate_batches=1, prewarm_batches=100)
    cdr.submit([item(f"a{i}", 100, prefix=("A",)) for i in range(40)], "j")
    for s in "BCD":
        cdr.submit([item(f"{s}{i}", 100, prefix=(s,)) for i in range(10 + "BCD".index(s))], "j")
    (b, _), cmds = _script_commands(cdr, redis_url, lambda: cdr.claim(contract(8, 800), "w"))
    assert b.prefix == ["A"] and b.warming == inst("D")  # the staged shape with the most tokens warms
    for s in "BCD":
        reads = [x for x in cmds if x[0].upper() == "HMGET" and x[1] == MK.inst(inst(s))]
        assert len(reads) == 1, (s, reads)
    assert state(cdr, inst("D")) == "warming" and state(cdr, inst("B")) == "staged"
