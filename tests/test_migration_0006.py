"""Migration 0006: the registry marks of store-waiting ids ('s<seq>:<sum>' in M:in:J:sums, schema 5)
move to the job's packed stored ids (M:in:J:stored) and their segment's id list (M:seg:N:ids). The
schema-5 layout is made from a live schema-6 run by moving each id back, so the migration must give
back what the run had: every id waiting with its sum in its segment, the registry as it was."""

from __future__ import annotations

import importlib
import time

import redis

from conductor.client import Conductor
from conductor.redis_contract import keys as K
from conductor.redis_contract import schema
from conductor.redis_contract.packed_ids import stored_count, stored_sums
from conductor.tier.feeder import Feeder
from conductor.tier.object_store import Store
from conductor.verify import verify
from tests.conftest import item
from tests.helpers import contract, quick, results_for

M06 = importlib.import_module("conductor.migrations.0006_stored_ids")
MK = K.ModelKeys("m")


def to_schema5(r: redis.Redis, job: str) -> None:
    """The schema-5 layout of what a schema-6 run wrote: each stored id a registry mark again."""
    for name, seq in r.zrange(MK.segs, 0, -1, withscores=True):
        ids = [i.decode() for i in r.lrange(MK.seg_ids(name.decode()), 0, -1)]
        for iid, sm in zip(ids, stored_sums(r, MK, job, ids), strict=True):
            assert sm is not None
            r.hset(MK.job_sums(job), iid, f"s{int(seq)}:{sm}")
        r.delete(MK.seg_ids(name.decode()))
    r.delete(MK.job_stored(job))
    r.set(K.SCHEMA_KEY, 5)


def layout(r: redis.Redis, job: str) -> tuple[dict, dict, int, dict]:
    """What the stored ids mean, whatever the order of records in a bucket or ids in a list."""
    segs = {n.decode(): sorted(i.decode() for i in r.lrange(MK.seg_ids(n.decode()), 0, -1))
            for n in r.zrange(MK.segs, 0, -1)}
    ids = [i for v in segs.values() for i in v]
    return (r.hgetall(MK.job_sums(job)), segs, stored_count(r, MK, job),
            dict(zip(ids, stored_sums(r, MK, job, ids), strict=True)))


def test_stored_marks_move_to_the_packed_form_and_the_backlog_drains_once(redis_url, tmp_path):
    c = Conductor.from_url(redis_url, store=Store(str(tmp_path / "store")))
    c.ensure_model("m")
    quick(c, resident_tokens=500)
    its = [item(f"i{i}", 50, prefix=(f"s{i % 2}",)) for i in range(60)]
    c.submit(its, "j")
    assert int(c.r.hget(MK.intake, "stored_items")) == 50
    after = layout(c.r, "j")
    to_schema5(c.r, "j")
    assert not c.r.exists(MK.job_stored("j")) and c.r.hlen(MK.job_sums("j")) == 60
    assert schema.migrate(c.r) == [6]
    assert layout(c.r, "j") == after
    M06.up(c.r)  # a second run finds no mark: nothing changes
    assert layout(c.r, "j") == after
    assert verify(c.r, "m", items=True).ok
    c2 = Conductor.from_url(redis_url, store=Store(str(tmp_path / "store")))
    assert c2.submit(its, "j").duplicates == 60  # every id known: lanes and store
    feeder, got = Feeder(c2, c2.tier.store, "m"), []
    deadline = time.monotonic() + 120  # a condition, not a count: a loaded machine waits longer
    while len(got) < len(its) and time.monotonic() < deadline:
        feeder.feed()
        b, _why = c2.claim(contract(size=8, tokens=400), "w")
        if b is None:
            time.sleep(0.02)
        else:
            c2.complete(b, results_for(b))
            got += [it.id for it in b.items]
    assert sorted(got) == sorted(it.id for it in its)
    assert stored_count(c2.r, MK, "j") == 0 and c2.r.hlen(MK.job_sums("j")) == 60
    assert verify(c2.r, "m", items=True).ok
