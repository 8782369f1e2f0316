"""Migration 0003: schema-2 data (the producer's counters inside M:state and M:job:J, the id
registry as q/d marks in M:job:J:items) moves to the schema-3 keys without losing an item or
a count. The schema-2 layout is made from a live schema-3 run by moving each field back, so the
migration must give back exactly the keys the run had (plus '-' sums for ids that had none)."""

from __future__ import annotations

import importlib

import redis

from conductor.client import Conductor
from conductor.redis_contract import keys as K
from conductor.redis_contract import schema
from conductor.redis_contract.records import Contract
from conductor.verify import verify
from tests.conftest import item
from tests.helpers import drain, quick, results_for

M03 = importlib.import_module("conductor.migrations.0003_producer_keys")
C = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)
MK = K.ModelKeys("m")


def dump(r: redis.Redis) -> dict:
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000))}


def to_schema2(r: redis.Redis, jobs: list[str]) -> None:
    """The schema-2 layout of what a schema-3 run wrote (conductor/redis_contract/keys.py before 0003)."""
    for f, v in r.hgetall(MK.intake).items():
        r.hset(MK.state, f, v)
    r.delete(MK.intake)
    for job in jobs:
        for f, v in r.hgetall(MK.job_intake(job)).items():
            r.hset(MK.job(job), f, v)
        r.delete(MK.job_intake(job))
        for iid in r.hkeys(MK.job_sums(job)):
            r.hsetnx(MK.job_items(job), iid, "q")
        r.rename(MK.job_sums(job), f"{MK.base}:job:{job}:sums")
    r.set(K.SCHEMA_KEY, 2)


def test_a_schema2_redis_comes_back_key_for_key_and_drains(redis_url):
    c = Conductor.from_url(redis_url)
    quick(c)
    c.submit([item(i, 10 + i) for i in range(10)], "j1")
    c.submit([item(i, 20 + i) for i in range(6)], "j2")
    b, _ = c.claim(C, "w")
    c.complete(b, results_for(b))
    c.claim(C, "w")  # one batch left in flight
    after = dump(c.r)
    to_schema2(c.r, ["j1", "j2"])
    assert c.r.exists(MK.intake) == 0 and c.r.hget(MK.state, "tokens") is not None
    assert schema.migrate(c.r) == [3, 4, 5, 6]  # 0004 to 0006 find nothing of their own to move here
    assert dump(c.r) == after
    # a second run changes nothing
    M03.up(c.r)
    assert dump(c.r) == after
    assert verify(c.r, "m", items=True).ok
    c2 = Conductor.from_url(redis_url)
    assert c2.submit([item(i, 10 + i) for i in range(10)], "j1").duplicates == 10  # the registry held
    drain(c2, C, consumer="w2")
    st1, st2 = c2.status("j1"), c2.status("j2")
    assert (st1["submitted"], st2["submitted"]) == (10, 6)
    assert verify(c2.r, "m", items=True).ok


def test_an_id_without_a_sum_stays_a_duplicate(redis_url):
    """Ids submitted before content sums were kept have a registry entry '-': a re-submit of the
    id is a duplicate whatever its content (as schema 2 did), never a second item."""
    c = Conductor.from_url(redis_url)
    quick(c)
    c.submit([item(i, 10) for i in range(3)], "j")
    to_schema2(c.r, ["j"])
    c.r.hdel(f"{MK.base}:job:j:sums", "1")
    schema.migrate(c.r)
    assert c.r.hget(MK.job_sums("j"), "1") == b"-"
    rep = Conductor.from_url(redis_url).submit([item(1, 99)], "j")
    assert (rep.accepted, rep.duplicates) == (0, 1)
    assert verify(c.r, "m", items=True).ok
