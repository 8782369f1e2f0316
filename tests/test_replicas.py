"""With wait_replicas, submit and complete return only once a replica holds their writes (WAIT),
else raise NotReplicated; sending the same call again is safe, and a worker keeps its results
until a replica confirms them. A real primary and a real replica (REPLICAOF)."""

from __future__ import annotations

import time

import pytest

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.errors import NotReplicated
from tests.conftest import item
from tests.helpers import quick
from tests.worker_kit import run_until_done, sim, worker


def _link_up(replica: EmbeddedRedis, timeout: float = 20.0) -> None:
    r = connect(replica.url)
    deadline = time.monotonic() + timeout
    while r.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)


@pytest.fixture()
def pair():
    primary = EmbeddedRedis().start()
    replica = EmbeddedRedis(extra=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    _link_up(replica)
    yield primary, replica
    replica.close()
    primary.close()


def test_a_confirmed_submit_and_complete_are_on_the_replica_when_they_return(pair):
    primary, replica = pair
    c = Conductor(connect(primary.url), wait_replicas=1, wait_timeout_ms=5000)
    quick(c)
    c.submit([item(i, 10) for i in range(40)], "j")
    on_replica = connect(replica.url)
    assert on_replica.hget("cdr:{m}:in:j", "submitted") == b"40"  # no polling: WAIT saw to it
    w = worker(c, engine=sim())
    run_until_done(w)
    assert on_replica.hget("cdr:{m}:job:j", "completed") == b"40"
    assert on_replica.xlen("cdr:{m}:job:j:results") == 40


def test_without_a_replica_the_write_is_reported_and_sending_it_again_is_safe(pair):
    primary, replica = pair
    # writes that must reach the replica get time for its acknowledgement on a loaded machine
    ok = Conductor(connect(primary.url), wait_replicas=1, wait_timeout_ms=5000)
    quick(ok)
    ok.submit([item(i, 10) for i in range(20)], "j")
    c = Conductor(connect(primary.url), wait_replicas=1, wait_timeout_ms=200)
    replica.stop()
    with pytest.raises(NotReplicated, match="0 of 1 replicas"):
        c.submit([item(i, 10) for i in range(20, 30)], "j")
    assert c.status("j")["submitted"] == 30  # on the primary, unconfirmed
    replica.start()
    _link_up(replica)
    rep = ok.submit([item(i, 10) for i in range(20, 30)], "j")  # the producer's re-run
    assert (rep.accepted, rep.duplicates) == (0, 10)
    assert connect(replica.url).hget("cdr:{m}:in:j", "submitted") == b"30"


def test_a_worker_keeps_its_results_until_a_replica_confirms_them(pair):
    primary, replica = pair
    c = Conductor(connect(primary.url), wait_replicas=1, wait_timeout_ms=100)
    quick(c)
    # the submit must reach the replica: time for its acknowledgement on a loaded machine
    Conductor(connect(primary.url), wait_replicas=1, wait_timeout_ms=5000).submit(
        [item(f"i{k:04d}", 10, max_tokens=4) for k in range(12)], "j")
    replica.stop()
    w = worker(c, engine=sim())
    for _ in range(50):
        w.turn()
        if w.retry:
            break
    assert w.retry  # written on the primary, unconfirmed: kept, and tried again
    w.turn()
    assert w.retry  # still unconfirmed on the next try
    replica.start()
    _link_up(replica)
    run_until_done(w)
    assert c.status("j")["completed"] == 12
    assert sorted(r.id for r in c.read_results("j")) == [f"i{k:04d}" for k in range(12)]


def test_a_moved_item_handed_in_to_its_new_shard_is_confirmed_as_a_submit_is(pair):
    """A change of S hands an item delivered before to its new shard with its count (lua/hand_in.lua):
    under wait_replicas that write is confirmed as a submit is, and without a replica the migration
    step stops with NotReplicated and the next step (the list still there) hands it in once."""
    from conductor.client import shard_migrate
    from conductor.redis_contract import keys as K
    from conductor.redis_contract import script_calls as calls
    from conductor.redis_contract.records import Contract
    primary, replica = pair
    # writes that must reach the replica get time for its acknowledgement on a loaded machine; the step
    # that must not, 200 ms
    c = Conductor(connect(primary.url), wait_replicas=1, wait_timeout_ms=5000)
    quick(c, "dvy", max_deliveries=3)
    c.submit([item("d0", 12, model="dvy", max_tokens=8)], "dj", seal=True)
    contract = Contract(model="dvy", max_batch_size=8, max_batch_tokens=4096, max_input_len=4096)
    batch, why = c.claim(contract, "gone")
    assert batch is not None, why
    assert calls.reclaim(K.ModelKeys("dvy"), "gone", force=False, min_idle_ms=0, count=10).run(c.scripts).batches == 1
    c.set_config("dvy", {"shards": 3})
    replica.stop()
    short = Conductor(connect(primary.url), wait_replicas=1, wait_timeout_ms=200)
    with pytest.raises(NotReplicated):
        for _ in range(20):
            shard_migrate.step(short, "dvy", "mv")
    replica.start()
    _link_up(replica)
    for _ in range(20):
        if c.drained(["dvy"]):
            break
        shard_migrate.step(c, "dvy", "mv")
    st = c.status("dj")
    assert st["submitted"] == 1 and st["pending"] == 1, st
    [new] = [n for n in c.shards("dvy") if c.r.llen(K.ModelKeys(n).reclaimed)]
    on_replica = connect(replica.url)
    assert on_replica.llen(K.ModelKeys(new).reclaimed) == 1
