"""Reclaim on a real redis-server: dead consumers lose their pending batches to the reclaimed
queue (served before lanes), live ones keep theirs, finished items are never redone, and a
consumer is deleted only once its pending list is empty."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from conductor.redis_contract import keys as K
from conductor.workers.engines.sim import SimEngine
from conductor.workers.worker import Worker, WorkerOptions
from tests.conftest import item
from tests.helpers import MK, contract, drain, quick, results_for


def consumer_names(cdr):
    return {row["name"] for row in cdr.consumers("m")}


def slow_worker_holding_a_batch(cdr) -> Worker:
    """A real Worker with a 0.6 s heartbeat TTL that claimed and admitted a batch and never steps it: a long
    batch in progress."""
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(4)], "j")
    w = Worker(cdr, SimEngine("m"), WorkerOptions(name="slow", heartbeat_ttl_s=0.6))
    w.register()
    assert w._pull()
    return w


@contextmanager
def heartbeat_thread(w: Worker) -> Iterator[threading.Thread]:
    """The worker's heartbeat thread, running for the block."""
    hb = threading.Thread(target=w._heartbeat_loop, daemon=True)
    hb.start()
    try:
        yield hb
    finally:
        w.stopping.set()
        w._hb_stop.set()  # the heartbeat thread's own stop (it outlives the loop while draining)
        hb.join()


def test_dead_consumer_batches_are_served_before_lanes(cdr):
    quick(cdr)
    cdr.submit([item(f"a{i}", 10) for i in range(8)], "j")
    dead, _ = cdr.claim(contract(size=8), "dead")  # no heartbeat key: a dead consumer
    cdr.submit([item(f"b{i}", 10) for i in range(8)], "j")
    res = cdr.reclaim_dead("m")
    assert res == {"consumers": 1, "batches": 1, "items": 8, "dead": 0, "in_flight": 1}
    assert cdr.r.llen(MK.reclaimed) == 1
    assert "dead" not in consumer_names(cdr)  # its pending list was emptied, then it was deleted
    b, _ = cdr.claim(contract(), "live")
    assert b.reclaimed and [i.id for i in b.items] == [i.id for i in dead.items]
    assert {i.deliveries for i in b.items} == {2}
    nxt, _ = cdr.claim(contract(), "live")
    assert not nxt.reclaimed and {i.id[0] for i in nxt.items} == {"b"}


def test_a_heartbeat_that_fails_once_on_a_bug_keeps_beating(cdr):
    """An unexpected error in one beat (a bug, not Redis) ended the heartbeat thread: the lease lapsed while the
    worker still ran its batch, and the next sweep handed the batch on (it would run twice)."""
    w = slow_worker_holding_a_batch(cdr)
    real, beats = w._beat, []

    def first_fails(claiming: bool = False) -> None:
        beats.append(1)
        if len(beats) == 1:
            raise TypeError("a bug in one beat")
        real(claiming)
    w._beat = first_fails
    with heartbeat_thread(w) as hb:
        for _ in range(6):
            time.sleep(0.25)
            assert cdr.reclaim_dead("m")["batches"] == 0
        assert hb.is_alive() and len(beats) >= 4


def test_live_consumer_with_extended_lease_is_never_robbed(cdr):
    """A real Worker's heartbeat thread keeps the key alive and extends the lease (XCLAIM JUSTID)."""
    w = slow_worker_holding_a_batch(cdr)
    (bid,) = [e.batch.batch_id for e in w.inflight.values()]
    with heartbeat_thread(w):
        for _ in range(6):
            time.sleep(0.25)
            assert cdr.reclaim_dead("m")["batches"] == 0
            # idle-time fallback: the lease extension keeps the entry's idle time under 0.2 s
            assert cdr.reclaim_consumer("m", "slow", min_idle_ms=400)["batches"] == 0
        p = cdr.r.xpending_range(MK.batches, K.GROUP, "-", "+", 10, consumername="slow")
        assert [x["message_id"].decode() for x in p] == [bid]
        assert p[0]["times_delivered"] == 1  # JUSTID extends without counting a delivery
        assert p[0]["time_since_delivered"] < 400
    time.sleep(0.7)  # heartbeat key expires: now it is dead
    assert cdr.reclaim_dead("m")["batches"] == 1
    assert "slow" not in consumer_names(cdr)


def test_idle_fallback_takes_an_unextended_lease_from_a_live_consumer(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(4)], "j")
    cdr.r.set(MK.heartbeat("stuck"), 1, px=60_000)
    cdr.claim(contract(), "stuck")
    time.sleep(0.3)
    assert cdr.reclaim_consumer("m", "stuck", min_idle_ms=1000)["batches"] == 0
    res = cdr.reclaim_consumer("m", "stuck", min_idle_ms=200)
    assert (res["batches"], res["items"], res["deleted"]) == (1, 4, 0)  # alive: kept as a consumer
    assert "stuck" in consumer_names(cdr)


def test_completed_items_are_not_redone(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(5)], "j")
    b, _ = cdr.claim(contract(), "dead")
    assert cdr.complete(b, results_for(b, "dead")[:2], final=False) == (2, 0)
    assert cdr.reclaim_dead("m")["items"] == 3
    again, _ = cdr.claim(contract(), "w")
    assert [i.id for i in again.items] == [i.id for i in b.items[2:]]
    cdr.complete(again, results_for(again))
    # the dead worker's late completion of the whole batch writes nothing twice
    assert cdr.complete(b, results_for(b, "dead")) == (0, 0)
    ids = sorted(r.id for r in cdr.read_results("j"))
    assert ids == ["0", "1", "2", "3", "4"]
    st = cdr.status("j")
    assert (st["completed"], st["pending"]) == (5, 0)
    state = cdr.r.hgetall(MK.state)
    assert state[b"inflight_items"] == b"0" and state[b"inflight_batches"] == b"0"


def test_consumer_is_deleted_only_once_its_pending_list_is_empty(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(30)], "j")
    for _ in range(3):
        cdr.claim(contract(size=10), "dead")
    keys = [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed]
    b, k, d, left, deleted = cdr.scripts.reclaim(keys=keys, args=["dead", 0, 0, 1])
    assert (b, k, left, deleted) == (1, 10, 1, 0)
    assert "dead" in consumer_names(cdr)  # two batches still pending: DELCONSUMER would lose them
    assert cdr.r.xpending(MK.batches, K.GROUP)["pending"] == 2
    b, k, d, left, deleted = cdr.scripts.reclaim(keys=keys, args=["dead", 0, 0, 5])
    assert (b, k, left, deleted) == (2, 20, 0, 1)
    assert "dead" not in consumer_names(cdr)
    # a live consumer with nothing pending is left alone
    cdr.r.set(MK.heartbeat("idle"), 1, px=60_000)
    cdr.r.xgroup_createconsumer(MK.batches, K.GROUP, "idle")
    assert cdr.scripts.reclaim(keys=keys, args=["idle", 0, 0, 5]) == [0, 0, 0, -1, 0]
    assert "idle" in consumer_names(cdr)
    assert sorted(i.id for b in drain(cdr, contract(size=10)) for i in b.items) == sorted(str(i) for i in range(30))


def test_reclaimed_batch_split_for_a_smaller_contract_keeps_its_order(cdr):
    quick(cdr)
    cdr.submit([item(f"{i:02d}", 100) for i in range(10)], "j")
    big, _ = cdr.claim(contract(size=10), "dead")
    cdr.submit([item(f"z{i}", 100) for i in range(4)], "j")
    cdr.reclaim_dead("m")
    got = []
    for size in (4, 4):
        b, _ = cdr.claim(contract(size=size), "small")
        assert b.reclaimed and len(b.items) == size
        got += [i.id for i in b.items]
    # the rest is still at the head of the reclaimed queue, ahead of the lanes
    assert cdr.r.llen(MK.reclaimed) == 1
    # a token budget splits too: 104 padded tokens per item, 300 tokens take two
    b, _ = cdr.claim(contract(size=64, tokens=300), "small")
    assert b.reclaimed and len(b.items) == 2 and b.padded_len == 104
    got += [i.id for i in b.items]
    assert got == [i.id for i in big.items]
    assert cdr.r.llen(MK.reclaimed) == 0
    assert int(cdr.r.hget(MK.state, "reclaimed_items")) == 0
    nxt, _ = cdr.claim(contract(), "small")
    assert not nxt.reclaimed and {i.id[0] for i in nxt.items} == {"z"}


def test_repeatedly_dying_items_travel_alone_then_go_to_the_dead_letter(cdr):
    quick(cdr, max_deliveries=4)
    cdr.submit([item(i, 10) for i in range(3)], "j")
    sizes = []
    for n in range(4):
        b, _ = cdr.claim(contract(), f"dead{n}")
        sizes.append(len(b.items))
        cdr.reclaim_dead("m")
        # from the third delivery on, items travel alone: drain the other two as well
        if len(b.items) == 1:
            for k in range(2):
                b, _ = cdr.claim(contract(), f"dead{n}x{k}")
                assert len(b.items) == 1
            cdr.reclaim_dead("m")
    assert sizes == [3, 3, 1, 1]
    assert cdr.r.xlen(MK.dead) == 3
    entry = cdr.r.xrange(MK.dead)[0][1]
    assert entry[b"deliveries"] == b"4" and b"died" in entry[b"error"]
    st = cdr.status("j")
    assert (st["failed"], st["pending"]) == (3, 0)
    assert {r.error.code for r in cdr.read_results("j")} == {"dead_letter"}
    assert cdr.claim(contract(), "w")[1] == "idle"


def test_a_dead_consumer_s_newest_batch_is_blamed_the_older_ones_are_not(cdr):
    """Innocent items that shared a dying worker with a poison batch get twice the deliveries."""
    quick(cdr, max_deliveries=2)
    cdr.submit([item(f"{i:02d}", 10) for i in range(4)], "j")
    for n in range(2):
        older, _ = cdr.claim(contract(size=2), f"d{n}")
        newer, _ = cdr.claim(contract(size=2), f"d{n}")
        res = cdr.reclaim_dead("m")
        if n == 1:
            # both batches at 2 deliveries: only the newest one (the last the worker took) is dead
            assert res["dead"] == 2 and {d[b"id"] for _, d in cdr.r.xrange(MK.dead)} == \
                {i.id.encode() for i in newer.items}
            break
    b, _ = cdr.claim(contract(size=2), "w")
    assert [i.deliveries for i in b.items] == [3] and b.items[0].id in {i.id for i in older.items}
