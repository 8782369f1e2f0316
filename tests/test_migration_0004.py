"""Migration 0004: what claim.lua and dead_retry.lua converted on every call (the one active
instance named in M:state, schema-1 dead letters holding a body instead of an item record) moves
once, without losing an item or a count. The schema-3 layout is made from a live schema-4 run by
moving each back, so the migration must give back what the run had: key for key, entry ids and
all, the activation time aside (the migration stamps it with the server's clock, as claim.lua did)."""

from __future__ import annotations

import importlib
import json
import time

import msgspec
import pytest
import redis

from conductor.client import Conductor
from conductor.errors import SchemaMismatch
from conductor.jobs.deadletter import DeadLetter
from conductor.redis_contract import keys as K
from conductor.redis_contract import schema
from conductor.redis_contract.records import Contract
from conductor.verify import verify
from tests.conftest import item
from tests.helpers import drain, quick, results_for

M04 = importlib.import_module("conductor.migrations.0004_current_fields")
C = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)
MK = K.ModelKeys("m")


def dump(r: redis.Redis) -> dict:
    """Every key's DUMP, but a stream's entries and last id instead (a copied stream counts the
    entries ever added afresh: DUMP differs where nothing a reader sees does), and M:active's
    members without their scores."""
    out = {}
    for k in sorted(r.scan_iter(count=1000)):
        if k == MK.active.encode():
            out[k] = sorted(r.zrange(k, 0, -1))
        elif r.type(k) == b"stream":
            out[k] = (r.xrange(k), r.xinfo_stream(k)["last-generated-id"])
        else:
            out[k] = r.dump(k)
    return out


def to_schema3(r: redis.Redis) -> list[str]:
    """The schema-3 layout of what a schema-4 run wrote: the active instance named in M:state
    (only one could be) and every dead letter holding its body ('d', the JSON [prompt, payload])
    instead of its record ('it'), under the same entry ids. Returns the instance."""
    (inst,) = [i.decode() for i in r.zrange(MK.active, 0, -1)]
    r.zrem(MK.active, inst)
    r.hset(MK.state, "active", inst)
    entries = r.xrange(MK.dead)
    last = r.xinfo_stream(MK.dead)["last-generated-id"]
    r.delete(MK.dead)
    for eid, f in entries:
        rec = json.loads(f.pop(b"it"))
        f[b"d"] = msgspec.json.encode(rec[4:])
        r.xadd(MK.dead, f, id=eid)
    r.execute_command("XSETID", MK.dead, last)
    r.set(K.SCHEMA_KEY, 3)
    return inst


def a_run_with_dead_letters(c: Conductor) -> None:
    quick(c, max_deliveries=1)
    c.submit([item(i, 10 + i, payload={"row": i} if i % 2 else None) for i in range(12)], "j1")
    c.claim(C, "dead")  # its items are dead-lettered once its consumer is reclaimed
    c.reclaim_dead("m")
    b, _ = c.claim(C, "w")
    c.complete(b, results_for(b))
    c.claim(C, "w")  # one batch left in flight
    c.r.xdel(MK.dead, c.r.xrange(MK.dead)[-1][0])  # the stream's last id is past its last entry


def test_a_schema3_redis_comes_back_key_for_key_and_drains(redis_url):
    c = Conductor.from_url(redis_url)
    a_run_with_dead_letters(c)
    assert c.r.xlen(MK.dead) == 3 and c.r.zcard(MK.active) == 1
    after = dump(c.r)
    inst = to_schema3(c.r)
    assert c.r.hget(MK.state, "active") == inst.encode() and not c.r.exists(MK.active)
    assert all(b"it" not in f for _e, f in c.r.xrange(MK.dead))
    with pytest.raises(SchemaMismatch, match="needs 6: run `conductor migrate`"):
        Conductor.from_url(redis_url)  # a worker or producer of schema 6 refuses to start
    t0 = int(time.time() * 1000)
    assert schema.migrate(c.r) == [4, 5, 6]
    assert dump(c.r) == after
    assert t0 - 1000 <= c.r.zscore(MK.active, inst) <= time.time() * 1000 + 1000
    # a second run changes nothing
    M04.up(c.r)
    assert dump(c.r) == after
    assert verify(c.r, "m", items=True).ok
    # The migrated Redis works as a schema-4 one: the dead letters retry, everything drains.
    c2 = Conductor.from_url(redis_url)
    c2.set_config("m", {"max_deliveries": 10})
    assert DeadLetter(c2).retry()["retried"] == 3
    c2.reclaim_consumer("m", "w", force=True)
    drain(c2, C, consumer="w2")
    st = c2.status("j1")
    # every item answered; the one whose dead letter was deleted keeps its dead-letter result
    assert (st["submitted"], st["pending"], st["failed"]) == (12, 0, 1)
    assert verify(c2.r, "m", items=True).ok


def test_a_copy_cut_short_is_finished_by_the_next_run(redis_url, monkeypatch):
    c = Conductor.from_url(redis_url)
    a_run_with_dead_letters(c)
    after = dump(c.r)
    to_schema3(c.r)
    # As if a run copied one page of the dead letters and died: the copy holds the first entry.
    step = c.r.register_script(M04._DEAD_LUA)
    assert int(step(keys=[MK.dead, f"{MK.base}:dead:v4"], args=[1])) == 0
    assert c.r.xlen(f"{MK.base}:dead:v4") == 1
    monkeypatch.setattr(M04, "PAGE", 2)  # and the rest in pages of two
    assert schema.migrate(c.r) == [4, 5, 6]
    assert dump(c.r) == after
    assert not c.r.exists(f"{MK.base}:dead:v4")


def test_a_dead_letter_whose_body_does_not_read_stays_refused(redis_url):
    c = Conductor.from_url(redis_url)
    a_run_with_dead_letters(c)
    to_schema3(c.r)
    eid, f = c.r.xrange(MK.dead)[0]
    c.r.delete(MK.dead)
    c.r.xadd(MK.dead, {**f, b"d": b"not json"}, id=eid)
    schema.migrate(c.r)
    assert c.r.xrange(MK.dead)[0][1][b"d"] == b"not json"  # copied as it was
    try:
        DeadLetter(c).retry()
    except Exception as e:  # noqa: BLE001
        assert "holds no readable item" in str(e)
    else:
        raise AssertionError("an unreadable dead letter was retried")


def test_a_redis_of_a_newer_schema_is_refused(redis_url):
    c = Conductor.from_url(redis_url)
    c.r.set(K.SCHEMA_KEY, schema.latest() + 1)
    with pytest.raises(SchemaMismatch, match=f"knows up to {schema.latest()}: upgrade it"):
        Conductor.from_url(redis_url)
