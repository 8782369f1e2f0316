"""Migration 0002: a Redis holding schema-1 data (lanes as streams, batches carrying a msgpack
blob) is moved to schema 2 (lanes as lists of item records) without losing or duplicating an
item. The schema-1 data is written by hand, field for field as the schema-1 scripts wrote it."""

from __future__ import annotations

import importlib
import json
import time
from collections import Counter

import msgspec
import pytest
import redis

from conductor.client import Conductor, connect
from conductor.redis_contract import keys as K
from conductor.redis_contract import schema
from conductor.redis_contract.records import Contract, PreparedItem
from conductor.redis_contract.script_calls import submit_args as _submit_args
from conductor.verify import verify
from tests.conftest import item
from tests.helpers import drain

MODEL, JOB = "m", "j"
BASE = "cdr:{m}"
M02 = importlib.import_module("conductor.migrations.0002_lane_lists")

# Lane items: two lanes of one shape instance. Ids, prompts and payloads carry non-ASCII text,
# quotes and a '/' in a payload (body text passes through as it is).
LANE0 = [item("a1", 100), item("a2", 98, payload={"k": [1, 2], "s": "x/y"}), item("é3", 101, max_tokens=7)]
LANE1 = [item("b1", 300, payload='quote " here'), item("b2", 299)]
# Batches claimed by consumer w1 (pending): c3 already has its result; d1 was delivered twice,
# so its next delivery is its third and it travels alone (lib_requeue.lua), as does d2.
PENDING = [(item("c1", 200), 1), (item("c2", 200), 1), (item("c3", 200), 1)]
PENDING2 = [(item("d1", 120), 2), (item("d2", 110), 1)]
# A schema-1 reclaimed entry: the same msgpack blob a batch carried.
RECLAIMED = [(item("r1", 50), 2), (item("r2", 48), 3)]
DONE = {"c3"}


def sig() -> str:
    return LANE0[0].sig


def inst() -> str:
    return f"{sig()}:1"


def record(it: PreparedItem) -> str:
    """The schema-2 item record, as the brief for schema 2 defines it: the body after its '['."""
    enc = msgspec.json.encode
    return "[" + ",".join([enc(it.id).decode(), enc(JOB).decode(), str(it.input_tokens), str(it.max_tokens)]) + \
        "," + it.body.decode()[1:]


def old_blob(lane: int, items: list[tuple[PreparedItem, int]], ts: int) -> bytes:
    """Schema 1 batch blob [sig, ep, lane, plen, mt, ts, flags, items]."""
    rows = [[it.id, JOB, it.input_tokens, it.max_tokens, it.body.decode(), dv] for it, dv in items]
    plen = -(-max(it.input_tokens for it, _ in items) // 8) * 8
    return msgspec.msgpack.encode([sig(), 1, lane, plen, max(it.max_tokens for it, _ in items), ts, 0, rows])


def write_schema1(r: redis.Redis) -> None:
    now = int(time.time() * 1000)
    s, i = sig(), inst()
    ik = f"{BASE}:inst:{i}"
    r.set("cdr:schema", 1)
    r.sadd("cdr:models", MODEL)
    r.zadd("cdr:jobs", {JOB: now})
    r.sadd(f"cdr:job:{JOB}:models", MODEL)
    # Thresholds that let a small queue dispatch at once (tests/helpers.py, quick).
    r.hset(f"{BASE}:cfg", mapping={"quiet_ms": 50, "release_batches": 0, "activate_batches": 0})
    r.hset(f"{BASE}:shape:{s}", mapping={"epoch": 1, "prefix": '["sys"]'})
    waiting_tokens = waiting_items = 0
    for lane, its in enumerate((LANE0, LANE1)):
        for it in its:
            r.xadd(f"{BASE}:lane:{i}:{lane}", {"id": it.id, "job": JOB, "tok": it.input_tokens,
                                                "mt": it.max_tokens, "d": it.body})
        rep = max(it.input_tokens for it in its)
        tokens = sum(it.input_tokens for it in its)
        r.hset(f"{BASE}:lanemeta:{i}:{lane}", mapping={"rep": rep, "items": len(its), "tokens": tokens,
                                                        "last_ms": now - 10_000, "since_ms": now - 10_000})
        r.zadd(f"{ik}:lanes", {lane: rep})
        r.zadd(f"{ik}:fill", {lane: len(its) * (-(-rep // 8) * 8)})
        r.zadd(f"{ik}:touch", {lane: now})
        waiting_tokens += tokens
        waiting_items += len(its)
    r.hset(ik, mapping={"state": "active", "sig": s, "epoch": 1, "created_ms": now - 60_000,
                        "tokens": waiting_tokens, "items": waiting_items, "batches": 2, "lane_seq": 4,
                        "rr": -1, "idx": "stale", "last_intake_ms": now - 60_000})
    everything = [*LANE0, *LANE1, *(it for it, _ in [*PENDING, *PENDING2, *RECLAIMED])]
    r.hset(f"{BASE}:job:{JOB}:items", mapping={it.id: "d" if it.id in DONE else "q" for it in everything})
    r.hset(f"{BASE}:job:{JOB}", mapping={"submitted": len(everything), "completed": len(DONE),
                                         "submitted_tokens": sum(it.input_tokens for it in everything)})
    r.xadd(f"{BASE}:job:{JOB}:results", {"id": "c3", "r": json.dumps({"id": "c3", "error": None})})
    # Pending batches, delivered to w1 as claim.lua did (XADD then XREADGROUP).
    r.xgroup_create(f"{BASE}:batches", "workers", id="$", mkstream=True)
    for lane, its in ((2, PENDING), (4, PENDING2)):
        r.xadd(f"{BASE}:batches", {"sig": s, "ep": 1, "lane": lane, "n": len(its), "plen": 200, "w": "w1",
                                   "ts": now - 5_000, "b": old_blob(lane, its, now - 5_000)})
        r.xreadgroup("workers", "w1", {f"{BASE}:batches": ">"}, count=1)
    r.rpush(f"{BASE}:reclaimed", old_blob(3, RECLAIMED, now - 20_000))
    r.hset(f"{BASE}:state", mapping={
        "gate": 1, "active": i, "tokens": waiting_tokens, "items": waiting_items, "submitted": len(everything),
        "completed": len(DONE), "last_intake_ms": now - 60_000, "batches": 2, "inflight_batches": 2,
        "inflight_items": len(PENDING) + len(PENDING2), "reclaimed_items": len(RECLAIMED)})


def snapshot(r: redis.Redis) -> dict:
    """Every key with its type and contents, to compare two states of a Redis."""
    read = {b"string": r.get, b"list": lambda k: r.lrange(k, 0, -1), b"hash": r.hgetall,
            b"set": r.smembers, b"zset": lambda k: r.zrange(k, 0, -1, withscores=True),
            b"stream": lambda k: r.xrange(k)}
    out = {}
    for k in r.scan_iter(count=1000):
        t = r.type(k)
        out[k] = (t, read[t](k))
    return out


@pytest.fixture()
def r1(redis_url: str) -> redis.Redis:
    r = connect(redis_url)
    write_schema1(r)
    return r


def test_schema1_is_refused_until_migrated(r1):
    with pytest.raises(Exception, match="conductor migrate"):
        Conductor(r1)


def test_lanes_become_lists_and_pending_work_is_reclaimed(r1):
    assert schema.migrate(r1) == [2, 3, 4, 5, 6]
    assert r1.get("cdr:schema") == b"6"
    i = inst()
    for lane, its in enumerate((LANE0, LANE1)):
        key = f"{BASE}:lane:{i}:{lane}"
        assert r1.type(key) == b"list"
        assert [x.decode() for x in r1.lrange(key, 0, -1)] == [record(it) for it in its]
        assert r1.lrange(f"{BASE}:lanetok:{i}:{lane}", 0, -1) == [str(it.input_tokens).encode() for it in its]
        # Lane bookkeeping is the same in both schemas.
        assert int(r1.hget(f"{BASE}:lanemeta:{i}:{lane}", "items")) == len(its)
    rec0 = json.loads(r1.lindex(f"{BASE}:lane:{i}:0", 1))
    assert rec0 == ["a2", JOB, 98, 16, "pa2", {"k": [1, 2], "s": "x/y"}]

    # The pending batch left the batches stream and the group ...
    assert r1.xlen(f"{BASE}:batches") == 0
    assert r1.xpending(f"{BASE}:batches", "workers")["pending"] == 0
    # ... and joined the reclaimed queue after the converted old entry (in place, its highest
    # delivery count), without the done item, counting the coming delivery.
    entries = [msgspec.msgpack.decode(x) for x in r1.lrange(f"{BASE}:reclaimed", 0, -1)]
    d1, d2 = (it for it, _ in PENDING2)
    assert entries == [
        [sig(), 1, 3, 3, [50, 48], [record(it) for it, _ in RECLAIMED]],
        [sig(), 1, 2, 2, [200, 200], [record(it) for it, _ in PENDING if it.id not in DONE]],
        [sig(), 1, 4, 3, [120], [record(d1)]],
        [sig(), 1, 4, 3, [110], [record(d2)]],
    ]
    state = r1.hgetall(f"{BASE}:state")
    assert int(state[b"inflight_batches"]) == 0
    assert int(state[b"inflight_items"]) == 0
    assert int(state[b"reclaimed_items"]) == len(RECLAIMED) + len(PENDING) + len(PENDING2) - len(DONE)
    assert int(r1.hget(f"{BASE}:intake", "items")) == len(LANE0) + len(LANE1)
    # Every counter agrees with the data it counts, and every queued item is in exactly one place.
    rep = verify(r1, MODEL, items=True)
    assert rep.ok, (rep.drift, rep.problems)


def test_running_again_changes_nothing(r1):
    schema.migrate(r1)
    before = snapshot(r1)
    assert schema.migrate(r1) == []
    M02.up(r1)  # the migration itself, even with the version not yet recorded
    assert snapshot(r1) == before


def test_a_lane_converted_before_a_crash_is_left_alone(r1):
    i = inst()
    # As if a run converted lane 0 and died: lane 0 is new, lane 1 still old.
    lane0 = f"{BASE}:lane:{i}:0"
    r1.delete(lane0)
    r1.rpush(lane0, *[record(it) for it in LANE0])
    r1.rpush(f"{BASE}:lanetok:{i}:0", *[it.input_tokens for it in LANE0])
    schema.migrate(r1)
    assert [x.decode() for x in r1.lrange(lane0, 0, -1)] == [record(it) for it in LANE0]
    assert r1.llen(f"{BASE}:lanetok:{i}:0") == len(LANE0)
    assert [x.decode() for x in r1.lrange(f"{BASE}:lane:{i}:1", 0, -1)] == [record(it) for it in LANE1]


def test_records_match_what_schema2_submit_writes(r1):
    schema.migrate(r1)
    c = Conductor(r1)
    # The same items submitted now, to another model: each record must read as the one the
    # migration wrote (ids with '/' and non-ASCII text included). Bytes may differ in escapes:
    # the producer writes records with msgspec, which leaves '/' as it is; cjson writes '\/'.
    ref = [item(it.id, it.input_tokens, model="ref", max_tokens=it.max_tokens,
                payload=msgspec.json.decode(it.body)[1]) for it in [*LANE0, *LANE1]]
    ref.append(item("x/y", 77, model="ref", payload="é/"))
    # Straight through submit.lua: the same ids under a second model of one job are refused at the
    # edge (one id, one item of a job); submit.lua checks ids per model.
    mk = K.ModelKeys("ref")
    c.ensure_model("ref")
    c.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=_submit_args(JOB, ref))
    written = {}
    for k in r1.scan_iter(match="cdr:{ref}:lane:*", _type="list"):
        for rec in r1.lrange(k, 0, -1):
            written[json.loads(rec)[0]] = rec
    migrated = {}
    for lane in (0, 1):
        for rec in r1.lrange(f"{BASE}:lane:{inst()}:{lane}", 0, -1):
            migrated[json.loads(rec)[0]] = rec
    assert set(written) == {it.id for it in ref}
    assert {k: json.loads(v) for k, v in migrated.items()} == {
        k: json.loads(v) for k, v in written.items() if k != "x/y"}
    # A '/' in an id: write a schema-1 lane entry for it and migrate it in place.
    odd = ref[-1]
    lane = f"{BASE}:lane:{inst()}:9"
    r1.xadd(lane, {"id": odd.id, "job": JOB, "tok": odd.input_tokens, "mt": odd.max_tokens, "d": odd.body})
    M02.up(r1)
    assert [json.loads(v) for v in r1.lrange(lane, 0, -1)] == [json.loads(written["x/y"])]


def test_draining_after_migration_returns_every_item_once(r1):
    schema.migrate(r1)
    c = Conductor(r1)
    batches = drain(c, Contract(model=MODEL, max_batch_size=64, max_batch_tokens=8192, max_input_len=4096),
                    consumer="w2")
    got = Counter(it.id for b in batches for it in b.items)
    want = [it.id for it in [*LANE0, *LANE1, *(x for x, _ in [*PENDING, *PENDING2, *RECLAIMED])]
            if it.id not in DONE]
    assert got == Counter(want)
    by_id = {it.id: it for b in batches for it in b.items}
    assert by_id["a2"].payload == {"k": [1, 2], "s": "x/y"} and by_id["a2"].prompt == "pa2"
    assert by_id["é3"].max_tokens == 7
    # Reclaimed work keeps its delivery count; each batch is one lane of one shape.
    assert by_id["r2"].deliveries == 3 and by_id["d2"].deliveries == 3 and by_id["c1"].deliveries == 2
    assert by_id["a1"].deliveries == 1
    assert all(b.shape == sig() for b in batches)
    state = {**r1.hgetall(f"{BASE}:state"), **r1.hgetall(f"{BASE}:intake")}
    for name in ("items", "tokens", "inflight_batches", "inflight_items", "reclaimed_items"):
        assert int(state.get(name.encode(), 0)) == 0, name
    job = r1.hgetall(f"{BASE}:job:{JOB}")
    assert int(job[b"completed"]) == len(want) + len(DONE)
    assert set(r1.hvals(f"{BASE}:job:{JOB}:items")) == {b"d"}
    assert verify(r1, MODEL, items=True).ok


def test_a_body_schema2_would_refuse_is_rebuilt_from_its_first_two_elements(r1):
    # Schema-1 submit took these bodies; their text cannot simply follow the record's head.
    lane = f"{BASE}:lane:{inst()}:7"
    r1.xadd(lane, {"id": "w1", "job": JOB, "tok": 5, "mt": 3, "d": ' ["pw", {"a": 1}]'})
    r1.xadd(lane, {"id": "w2", "job": JOB, "tok": 6, "mt": 3, "d": '["px", null, "extra"]'})
    r1.xadd(lane, {"id": "w3", "job": JOB, "tok": 7, "mt": 3, "d": '["py"]'})
    schema.migrate(r1)
    recs = [json.loads(x) for x in r1.lrange(lane, 0, -1)]
    assert recs == [["w1", JOB, 5, 3, "pw", {"a": 1}], ["w2", JOB, 6, 3, "px", None], ["w3", JOB, 7, 3, "py"]]
    assert r1.lrange(f"{BASE}:lanetok:{inst()}:7", 0, -1) == [b"5", b"6", b"7"]


def test_an_unreadable_lane_entry_stops_the_migration_with_the_lane_untouched(r1):
    lane = f"{BASE}:lane:{inst()}:0"
    r1.xadd(lane, {"id": "bad", "job": JOB, "tok": 5, "mt": 3, "d": "not json"})
    with pytest.raises(redis.ResponseError, match="ERR_MIGRATE"):
        schema.migrate(r1)
    assert r1.get("cdr:schema") == b"1"
    assert r1.type(lane) == b"stream" and r1.xlen(lane) == len(LANE0) + 1
