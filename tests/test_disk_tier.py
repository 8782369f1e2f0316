"""The disk tier (issue 18): items beyond a model's resident_tokens wait in store segments and are
fed back into the lanes as they drain (conductor/tier/spill.py, lua/register_segment.lua, submit.lua)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from conductor.client import Conductor
from conductor.errors import ConductorError
from conductor.redis_contract import keys as K
from conductor.redis_contract.item_record import content_sum, record_head
from conductor.redis_contract.packed_ids import stored_count, stored_sums
from conductor.redis_contract.script_calls import submit_args as _submit_args
from conductor.redis_contract.segment_record import file_name
from conductor.tier.feeder import Feeder
from conductor.tier.object_store import Store
from conductor.tier.segments import read_segment
from tests.conftest import cli, follow_with_workers, item
from tests.helpers import MK, contract, quick, results_for


def _items(n: int, tokens: int = 50, shapes: int = 2, start: int = 0) -> list:
    return [item(f"i{i}", tokens, prefix=(f"s{i % shapes}",)) for i in range(start, start + n)]


def _tiered(redis_url: str, store_url: str, ceiling: int) -> Conductor:
    c = Conductor.from_url(redis_url, store=Store(store_url))
    c.ensure_model("m")
    quick(c, resident_tokens=ceiling)
    return c


def _intake(c: Conductor) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in c.r.hgetall(MK.intake).items() if k != b"last_intake_ms"}


def _segments(c: Conductor) -> list[tuple[str, dict[str, str]]]:
    out = []
    for n in c.r.zrange(MK.segs, 0, -1):
        rec = {k.decode(): v.decode() for k, v in c.r.hgetall(MK.seg(n.decode())).items()}
        out.append((n.decode(), rec))
    return out


def _run_down(
    c: Conductor,
    feeder: Feeder,
    *,
    size: int = 8,
    tokens: int = 400,
    timeout: float = 30,
    sample: list[int] | None = None,
    items: list | None = None,
) -> list[str]:
    """Feed and claim until the model is idle; the ids of every batch, completed. With ``items``,
    every batch must be of one shape (each item's signature)."""
    sig_of = {it.id: it.sig for it in items} if items is not None else None
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        feeder.feed()
        if sample is not None:
            sample.append(int(c.r.hget(MK.intake, "tokens") or 0))
        b, why = c.claim(contract(size=size, tokens=tokens), "w")
        if b is None:
            # a bad segment's items stay counted (waiting for --repair): nothing else left is idle too
            if why == "idle" or (not int(c.r.hget(MK.intake, "tokens") or 0) and feeder.next_segment() is None):
                return got
            time.sleep(0.01)
            continue
        if sig_of is not None:
            assert {sig_of[i.id] for i in b.items} == {b.shape}, "a batch of two shapes"
        got += [i.id for i in b.items]
        c.complete(b, results_for(b))
    raise AssertionError("model did not go idle")


def test_items_beyond_the_ceiling_go_to_pure_segments_in_arrival_order(redis_url, tmp_path):
    c = _tiered(redis_url, str(tmp_path / "store"), 1000)
    its = _items(100)
    rep = c.submit(its, "j")
    assert rep.accepted == 100
    st = _intake(c)
    # 1,000 tokens (20 items) wait in Redis, 4,000 in segments of at most a quarter of the ceiling
    assert (st["tokens"], st["items"], st["stored_tokens"], st["stored_items"]) == (1000, 20, 4000, 80)
    assert c.r.hget(MK.job_intake("j"), "submitted") == b"100"
    segs = _segments(c)
    assert len(segs) == 16 and all(int(r["tokens"]) <= 250 for _, r in segs)
    sent = {json.loads(rec)[0]: rec for rec in _submit_args("j", its)[3::3]}
    order = []
    for name, rec in segs:
        seg = read_segment(c.tier.store, rec)
        assert seg.name == name and seg.job == "j" and len({seg.sig}) == 1
        ids = [json.loads(r)[0] for r in seg.records]
        assert {int(i[1:]) % 2 for i in ids} in ({0}, {1})  # one shape per segment
        assert ids == sorted(ids, key=lambda i: int(i[1:]))  # arrival order within it
        assert all(r == sent[i] for r, i in zip(seg.records, ids, strict=True))  # the bytes submit.lua gets
        order += ids
    # a stored id waits in the job's stored ids (16 bytes), not the registry, and its segment names it
    assert c.r.hget(MK.job_sums("j"), "i99") is None and c.r.hget(MK.job_sums("j"), "i0") is not None
    assert stored_sums(c.r, MK, "j", ["i99", "i0"]) == [content_sum(record_head("j"), its[99]), None]
    assert stored_count(c.r, MK, "j") == 80
    assert sorted(i.decode() for name, _r in segs for i in c.r.lrange(MK.seg_ids(name), 0, -1)) == sorted(order)
    # a re-run adds nothing: the Redis part and the stored part are both known
    again = c.submit(its, "j")
    assert (again.accepted, again.duplicates) == (0, 100)
    assert _intake(c)["stored_items"] == 80 and len(_segments(c)) == 16


def test_fed_items_are_stored_byte_for_byte_and_every_id_runs_once(redis_url, tmp_path):
    c = _tiered(redis_url, str(tmp_path / "store"), 1000)
    its = _items(200)
    c.submit(its, "j")
    sample: list[int] = []
    got = _run_down(c, Feeder(c, c.tier.store, "m"), sample=sample, items=its)
    assert sorted(got) == sorted(it.id for it in its)  # every id once
    assert max(sample) <= 1000  # never more than the ceiling waiting in Redis
    st = _intake(c)
    assert (st["tokens"], st["items"], st["stored_tokens"], st["stored_items"]) == (0, 0, 0, 0)
    assert _segments(c) == [] and not list((tmp_path / "store" / "segments").rglob("*.parquet"))
    assert c.status("j")["completed"] == 200
    # the registry holds plain sums again: a re-run is a duplicate, not a new item
    assert c.submit(its, "j").duplicates == 200


def test_feeding_takes_the_active_shapes_segments_first_and_stays_under_the_ceiling(redis_url, tmp_path):
    c = _tiered(redis_url, str(tmp_path / "store"), 400)
    c.submit([item(f"a{i}", 50, prefix=("A",)) for i in range(8)], "j")  # 400 tokens: the ceiling
    c.submit([item(f"b{i}", 50, prefix=("B",)) for i in range(8)], "j")  # older segments, shape B
    c.submit([item(f"a{i}", 50, prefix=("A",)) for i in range(8, 16)], "j")  # newer ones, shape A
    sig_a = item("x", 1, prefix=("A",)).sig
    assert [r["sig"] == sig_a for _, r in _segments(c)] == [False, False, False, False, True, True, True, True]
    b, _ = c.claim(contract(size=2, tokens=200), "w")  # A is the active shape now, 300 tokens wait
    assert b is not None and b.shape == sig_a
    f = Feeder(c, c.tier.store, "m")
    f.feed()
    assert int(c.r.hget(MK.intake, "tokens")) <= 400
    assert f.loaded_segments == 1
    left = [r["sig"] == sig_a for _, r in _segments(c)]
    assert left == [False, False, False, False, True, True, True]  # an A segment went first, B's wait


def _shape_stored(c: Conductor) -> dict[str, int]:
    """shape -> M:shape:S stored_tokens, for every shape that holds tokens (a count fed to 0 stays)."""
    out = {}
    for k in c.r.scan_iter(match=MK.shape("*")):
        if k.endswith(b":segs"):
            continue
        v = c.r.hget(k, "stored_tokens")
        if v is not None and int(v):
            out[k.decode()[len(MK.shape("")) :]] = int(v)
    return out


def test_each_shape_counts_its_stored_tokens_and_feeding_takes_them_down(redis_url, tmp_path):
    c = _tiered(redis_url, str(tmp_path / "store"), 1000)
    its = _items(100)  # two shapes, 5,000 tokens: 4,000 of them in segments
    c.submit(its, "j")
    by_shape: dict[str, int] = {}
    for _, rec in _segments(c):
        assert rec["shape"] == rec["sig"]  # a job of its own tenant in batch priority: the plain signature
        by_shape[rec["shape"]] = by_shape.get(rec["shape"], 0) + int(rec["tokens"])
    assert _shape_stored(c) == by_shape and sum(by_shape.values()) == _intake(c)["stored_tokens"] == 4000
    f = Feeder(c, c.tier.store, "m")
    served = None
    while True:  # batches of 3 (168 padded tokens) until the shape waits for its segments, with room for one
        b, why = c.claim(contract(size=3, tokens=200), "w")
        if b is None:
            break
        served = b
        c.complete(b, results_for(b))
    assert why == "wait" and served is not None
    b = served
    f.feed()  # the served shape's segment first, other shapes' only up to the ceiling less the reserve
    assert f.loaded_segments == 1
    after = _shape_stored(c)
    assert after[b.shape] == by_shape[b.shape] - 250 and sum(after.values()) == _intake(c)["stored_tokens"]
    _run_down(c, f, items=its)
    assert _shape_stored(c) == {} and _intake(c)["stored_tokens"] == 0


def test_a_served_shape_waits_for_its_segments_instead_of_draining(redis_url, tmp_path):
    """A shape whose segments wait in the store is not at its end: its instance neither drains into a
    padded tail nor is finished while the feeder has room for its next segment, so the fed items join
    the same instance and the shape is served in one piece (issue 37)."""
    c = _tiered(redis_url, str(tmp_path / "store"), 1000)
    quick(c, resident_tokens=1000, budget_tokens=168, budget_items=3)  # the claimer's contract, as a worker's
    its = _items(30, shapes=1)  # 1,500 tokens of one shape: 20 items in Redis, 10 in two segments
    c.submit(its, "j")
    assert _intake(c)["items"] == 20 and len(_segments(c)) == 2
    got, epochs = [], set()
    while True:
        b, why = c.claim(contract(size=4, tokens=200), "w")
        if b is None:
            break
        got += [i.id for i in b.items]
        epochs.add(b.epoch)
        c.complete(b, results_for(b))
    # full batches of 3 (padded to 56 tokens): the 2 left are no full batch, and the shape's segments
    # wait: 'wait', not a padded tail, and the instance stays active (not drained, not finished)
    assert why == "wait" and len(got) == 18
    inst = f"{its[0].sig}:{epochs.pop()}"
    assert c.r.hget(MK.inst(inst), "state") == b"active"
    f = Feeder(c, c.tier.store, "m")
    got += _run_down(c, f, size=4, tokens=200, items=its)
    assert sorted(got) == sorted(it.id for it in its)
    assert int(c.r.hget(MK.state, "activations")) == 1  # one piece
    assert int(c.r.hget(MK.state, "shapes_finished")) == 1


def test_a_full_redis_cuts_a_served_shape_at_its_densest_lanes(redis_url, tmp_path):
    """While a served shape's segments wait and Redis has no room for the next, a batch filled across
    lanes starts at the run of lanes that pads least per item, not at the shortest lane (issue 37):
    shortest-first leaves the long items in Redis and cuts each fed segment's short ones in sparse,
    wide batches."""
    c = _tiered(redis_url, str(tmp_path / "store"), 2400)  # segments of 600 tokens
    quick(c, resident_tokens=2400, budget_tokens=2000, budget_items=4)
    sparse = [item(f"s{t}", t, prefix=("A",)) for t in (8, 100, 200, 300)]
    dense = [item(f"d{t}", t, prefix=("A",)) for t in (401, 409, 417, 425)]  # a lane each, none ready
    c.submit(sparse + dense, "j")  # 2,260 tokens: no room for a 600-token segment under 2,400
    c.submit([item(f"x{i}", 150, prefix=("A",)) for i in range(4)], "j")
    assert _intake(c)["items"] == 8 and len(_segments(c)) == 1
    b, _ = c.claim(contract(size=4, tokens=2000), "w")
    # shortest first: 8, 100, 200 and 300 padded to 304 (608 tokens of padding); densest: 76
    assert b is not None and sorted(i.id for i in b.items) == sorted(it.id for it in dense)
    assert b.padded_len == 432
    c.complete(b, results_for(b))
    f = Feeder(c, c.tier.store, "m")
    got = [i.id for i in b.items] + _run_down(c, f, size=4, tokens=2000)
    assert sorted(got) == sorted(f"{p}" for p in ["s8", "s100", "s200", "s300", "d401", "d409", "d417", "d425",
                                                    "x0", "x1", "x2", "x3"])


def test_a_shape_activated_long_after_its_slice_came_in_still_waits_for_its_segments(redis_url, tmp_path):
    """The bound on waiting for the store counts from the activation too, not from the slice's intake
    alone: a shape whose first items came in with the submit, longer than hygiene_idle_ms before it
    is served, waits for its next segment instead of draining them at once as a padded tail and
    being taken up again as a second piece (issue 37)."""
    c = _tiered(redis_url, str(tmp_path / "store"), 100)
    its = _items(10, shapes=1)  # 2 items in Redis, 8 in segments
    c.submit(its, "j")
    assert _intake(c)["items"] == 2
    quick(c, resident_tokens=1000, budget_tokens=400, budget_items=4, hygiene_idle_ms=300)  # room now
    time.sleep(0.4)  # the slice's intake is older than hygiene_idle_ms
    assert c.claim(contract(size=4, tokens=400), "w") == (None, "wait")
    f = Feeder(c, c.tier.store, "m")
    got = _run_down(c, f, size=4, tokens=400, items=its)
    assert sorted(got) == sorted(it.id for it in its)
    assert int(c.r.hget(MK.state, "activations")) == 1  # one piece


def test_the_feeder_finds_a_served_shapes_segment_behind_hundreds_of_others(redis_url, tmp_path):
    """A shape's own segment index (M:shape:S:segs): its next segment is found however many older
    segments of other shapes wait before it (the feeder's general look covers the oldest 256)."""
    c = _tiered(redis_url, str(tmp_path / "store"), 40)  # segments of 10 tokens: one item each
    c.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(4)], "j")  # the ceiling's worth, in Redis
    c.submit([item(f"b{i}", 10, prefix=("B",)) for i in range(300)], "j")
    c.submit([item(f"a{i}", 10, prefix=("A",)) for i in range(4, 8)], "j")
    sig_a = item("x", 1, prefix=("A",)).sig
    assert c.r.zcard(MK.segs) == 304 and c.r.zcard(MK.shape_segs(sig_a)) == 4
    b, _ = c.claim(contract(size=4, tokens=64), "w")
    assert b is not None and b.shape == sig_a and len(b.items) == 4
    c.complete(b, results_for(b))
    assert c.claim(contract(size=4, tokens=64), "w") == (None, "wait")  # A's segments wait: not finished
    f = Feeder(c, c.tier.store, "m")
    f.feed()
    assert c.r.zcard(MK.shape_segs(sig_a)) == 0 and c.r.zcard(MK.segs) == 300  # A's four, B's none
    b2, _ = c.claim(contract(size=4, tokens=64), "w")
    assert b2.shape == sig_a and b2.epoch == b.epoch and len(b2.items) == 4  # the same instance: one piece


def test_a_served_shape_whose_segment_is_lost_drains_after_the_bound(redis_url, tmp_path):
    """A segment the feeder cannot read keeps its shape's stored tokens until a repair: the shape
    waits for it no longer than hygiene_idle_ms, then drains as before."""
    store = str(tmp_path / "store")
    c = _tiered(redis_url, store, 1000)
    quick(c, resident_tokens=1000, hygiene_idle_ms=300)
    its = _items(25, shapes=1)
    c.submit(its, "j")
    ((name, rec),) = _segments(c)
    (tmp_path / "store" / rec["path"]).unlink()
    f = Feeder(c, c.tier.store, "m")
    t0 = time.monotonic()
    got = _run_down(c, f, size=4, tokens=200, items=its, timeout=10)
    assert len(got) == 20 and time.monotonic() - t0 < 5
    assert c.r.hget(MK.seg(name), "bad") and _shape_stored(c) == {its[0].sig: 250}
    v = cli("--store", store, "inspect", "m", "--verify", "--repair", url=redis_url, check=False)
    assert v.returncode == 0, v.stdout.decode() + v.stderr.decode()
    assert _shape_stored(c) == {} and _intake(c)["stored_tokens"] == 0


def test_crash_after_writing_a_segment_before_registering_it(redis_url, tmp_path):
    store = tmp_path / "store"

    class DiesAfterWriting(Store):
        def put(self, name: str, data: bytes) -> None:
            super().put(name, data)
            if name.startswith("segments/"):
                raise SystemExit("producer killed between the segment write and its registration")

    c = Conductor.from_url(redis_url, store=DiesAfterWriting(str(store)))
    c.ensure_model("m")
    quick(c, resident_tokens=200)
    its = _items(20)
    with pytest.raises(SystemExit):
        c.submit(its, "j")
    files = sorted(p.name for p in store.rglob("*.parquet"))
    assert len(files) == 1 and _segments(c) == []  # written, not registered: nothing counts it
    assert _intake(c).get("stored_items", 0) == 0 and c.r.hget(MK.job_intake("j"), "submitted") == b"4"
    c2 = _tiered(redis_url, str(store), 200)
    c2.submit(its, "j")
    assert files[0] in {Path(r["path"]).name for _, r in _segments(c2)}  # the same content, the same file
    assert len(list(store.rglob("*.parquet"))) == len(_segments(c2)) == 16
    assert c2.r.hget(MK.job_intake("j"), "submitted") == b"20" and _intake(c2)["stored_items"] == 16
    got = _run_down(c2, Feeder(c2, c2.tier.store, "m"), items=its)
    assert sorted(got) == sorted(it.id for it in its)


def test_crash_after_registering_a_segment_before_the_next(redis_url, tmp_path):
    store = tmp_path / "store"

    class DiesOnThirdSegment(Store):
        n = 0

        def put(self, name: str, data: bytes) -> None:
            if name.startswith("segments/"):
                DiesOnThirdSegment.n += 1
                if DiesOnThirdSegment.n == 3:
                    raise SystemExit("producer killed after two registrations")
            super().put(name, data)

    c = Conductor.from_url(redis_url, store=DiesOnThirdSegment(str(store)))
    c.ensure_model("m")
    quick(c, resident_tokens=200)
    its = _items(20)
    with pytest.raises(SystemExit):
        c.submit(its, "j")
    assert len(_segments(c)) == 2 and _intake(c)["stored_items"] == 2
    c2 = _tiered(redis_url, str(store), 200)
    rep = c2.submit(its, "j")
    assert (rep.accepted, rep.duplicates) == (14, 6)
    assert c2.r.hget(MK.job_intake("j"), "submitted") == b"20" and _intake(c2)["stored_items"] == 16
    got = _run_down(c2, Feeder(c2, c2.tier.store, "m"), items=its)
    assert sorted(got) == sorted(it.id for it in its)


def test_a_feeder_that_died_after_loading_loads_nothing_twice(redis_url, tmp_path):
    c = _tiered(redis_url, str(tmp_path / "store"), 100)
    its = _items(10, shapes=1)
    c.submit(its, "j")
    name, rec = _segments(c)[0]
    seg = read_segment(c.tier.store, rec)
    from conductor.redis_contract.script_calls import load_args

    first = c.scripts.submit(keys=[MK.base, MK.cfg, MK.state], args=load_args(seg))  # loaded, not dropped
    assert all(x >= 0 for x in first)
    again = c.scripts.submit(keys=[MK.base, MK.cfg, MK.state], args=load_args(seg))
    assert again == [-1] * len(seg.records)
    got = _run_down(c, Feeder(c, c.tier.store, "m"), items=its)
    assert sorted(got) == sorted(it.id for it in its)


def test_memory_filesystem_store(redis_url):
    c = _tiered(redis_url, "memory://cdr-test-store", 300)
    its = _items(60)
    c.submit(its, "j")
    assert _intake(c)["stored_items"] == 54
    got = _run_down(c, Feeder(c, c.tier.store, "m"), items=its)
    assert sorted(got) == sorted(it.id for it in its)


def test_a_store_that_refuses_writes_is_one_clear_line_and_nothing_is_written(redis_url, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "model": "m", "prompt": "p", "input_tokens": 50, "max_tokens": 4}) + "\n"
            for i in range(20)
        )
    )
    c = Conductor.from_url(redis_url)
    c.ensure_model("m")
    quick(c, resident_tokens=200)
    p = cli("--store", str(blocker / "store"), "submit", "--create", str(src), "--job", "j", url=redis_url, check=False)
    err = p.stderr.decode().strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "store" in err and "cannot write" in err, err
    assert c.r.zcard(MK.segs) == 0 and not c.r.exists(MK.job_sums("j"))
    assert int(c.r.hget(MK.intake, "tokens") or 0) == 0
    with pytest.raises(ConductorError):
        Store(str(blocker / "store")).check_writable()


def test_a_worker_process_drains_a_backlog_ten_times_the_ceiling(redis_url, tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.setenv("CONDUCTOR_STORE", str(store))
    n, tokens, ceiling = 1200, 50, 6000  # 60,000 tokens: ten times the ceiling
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "model": "m",
                    "prefix": [f"s{i % 3}"],
                    "prompt": f"q{i}",
                    "input_tokens": tokens,
                    "max_tokens": 4,
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    c = Conductor.from_url(redis_url)
    c.ensure_model("m")
    quick(c, resident_tokens=ceiling, results_window=100)
    cli("submit", "--create", str(src), "--job", "big", url=redis_url)
    assert int(c.r.hget(MK.intake, "stored_tokens")) == n * tokens - ceiling
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(int(c.r.hget(MK.intake, "tokens") or 0))
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        rows = follow_with_workers(
            redis_url, "big", tmp_path / "out.jsonl", [("m", "w1")], batch_size=32, batch_tokens=2048
        )
    finally:
        stop.set()
        t.join()
    ids = [r["id"] for r in rows]
    assert len(ids) == n and len(set(ids)) == n  # every result once
    assert max(samples) <= ceiling + ceiling // 4 and len(samples) > 20
    st = {k.decode(): v.decode() for k, v in c.r.hgetall(MK.intake).items()}
    assert st["stored_tokens"] == "0" and st["tokens"] == "0" and c.r.zcard(MK.segs) == 0
    # the lease holder moved results past the window to the store while the reader followed
    assert c.r.llen(MK.job_rsegs("big")) > 0
    v = cli("inspect", "m", "--verify", url=redis_url, check=False)
    assert v.returncode == 0, v.stdout.decode() + v.stderr.decode()


def test_keys_of_the_tier_are_in_the_models_slot():
    mk = K.ModelKeys("m")
    assert mk.segs.startswith(mk.base) and mk.seg("ab").startswith(mk.base + ":seg:")
    assert file_name("abcdef") == "segments/ab/abcdef.parquet"


def _results(redis_url: str, job: str, store: str) -> list[dict]:
    out = cli("--store", store, "results", job, url=redis_url).stdout.decode().splitlines()
    return [json.loads(x) for x in out]


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_a_lost_segment_is_reported_with_its_items_and_repair_fails_them(redis_url, tmp_path, damage):
    store = str(tmp_path / "store")
    c = _tiered(redis_url, store, 200)
    its = _items(24, shapes=1)
    c.submit(its, "j")
    name, rec = _segments(c)[1]
    lost = [json.loads(r)[0] for r in read_segment(c.tier.store, rec).records]
    path = tmp_path / "store" / rec["path"]
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:-40] + b"\0" * 40)
    f = Feeder(c, c.tier.store, "m")
    got = _run_down(c, f, items=its)  # the feeder marks it bad, skips it, feeds the others
    assert sorted(got) == sorted(it.id for it in its if it.id not in lost)
    assert c.r.hget(MK.seg(name), "bad")
    v = cli("--store", store, "inspect", "m", "--verify", url=redis_url, check=False)
    out = v.stdout.decode()
    assert v.returncode == 1 and f"store segment {name}" in out and damage in out, out
    assert all(i in out for i in lost[:5]) and f"{len(lost)} item(s) wait in it" in out
    fix = cli("--store", store, "inspect", "m", "--verify", "--repair", url=redis_url, check=False)
    assert fix.returncode == 0, fix.stdout.decode() + fix.stderr.decode()
    assert f"{len(lost)} item(s) of job j answered with error store_segment_lost" in fix.stdout.decode()
    rows = _results(redis_url, "j", store)
    assert sorted(r["id"] for r in rows) == sorted(it.id for it in its)  # every id once
    failed = {r["id"] for r in rows if r["error"]}
    assert failed == set(lost) and all(r["error"]["code"] == "store_segment_lost" for r in rows if r["error"])
    st = c.status("j")
    assert (st["completed"], st["failed"], st["pending"]) == (24 - len(lost), len(lost), 0)
    assert _intake(c)["stored_items"] == 0 and _intake(c)["stored_tokens"] == 0 and _segments(c) == []
    assert cli("--store", store, "inspect", "m", "--verify", url=redis_url, check=False).returncode == 0


def test_verify_places_stored_items_in_the_ledger(redis_url, tmp_path):
    store = str(tmp_path / "store")
    c = _tiered(redis_url, store, 200)
    c.submit(_items(40), "j")
    v = cli("--store", store, "inspect", "m", "--verify", url=redis_url, check=False)
    assert v.returncode == 0, v.stdout.decode()
    c.r.hincrby(MK.intake, "stored_items", 3)  # drift in the tier's counters is found
    v = cli("--store", store, "inspect", "m", "--verify", url=redis_url, check=False)
    assert v.returncode == 1 and "stored_items" in v.stdout.decode()
    c.r.hincrby(MK.intake, "stored_items", -3)
    sig = _items(1)[0].sig
    c.r.hincrby(MK.shape(sig), "stored_tokens", 50)  # and in a shape's
    v = cli("--store", store, "inspect", "m", "--verify", url=redis_url, check=False)
    out = v.stdout.decode()
    assert v.returncode == 1 and MK.shape(sig) in out and "stored_tokens" in out, out


def test_a_fresh_worker_drains_a_backlog_larger_than_maxmemory(tmp_path, monkeypatch):
    """6 MB of prompts through a Redis of 5 MB: without the tier the submit is refused (QueueFull);
    with it, Redis holds the ceiling's worth and a worker process started afterwards drains it all."""
    from conductor.embedded import EmbeddedRedis
    from conductor.errors import QueueFull

    store = tmp_path / "store"
    monkeypatch.setenv("CONDUCTOR_STORE", str(store))
    n = 2400
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {"id": f"r{i}", "model": "m", "prefix": ["sys"], "prompt": f"{i} " + "x" * 2500, "max_tokens": 2}
            )
            + "\n"
            for i in range(n)
        )
    )
    extra = ["--maxmemory", "5mb", "--maxmemory-policy", "noeviction"]
    with EmbeddedRedis(extra=extra) as srv:
        plain = Conductor.from_url(srv.url)
        plain.ensure_model("m")
        quick(plain)
        with pytest.raises(QueueFull):  # the old way: the backlog does not fit
            plain.submit([item(f"p{i}", 600, payload="x" * 2500) for i in range(n)], "plain")
    with EmbeddedRedis(extra=extra) as srv:
        c = Conductor.from_url(srv.url)
        c.ensure_model("m")
        quick(c, resident_tokens=40_000)  # some 64 items of 626 tokens
        cli("submit", "--create", str(src), "--job", "big", url=srv.url)
        assert int(c.r.hget(MK.intake, "stored_items")) > n - 100
        rows = follow_with_workers(
            srv.url, "big", tmp_path / "out.jsonl", [("m", "fresh")], batch_size=32, batch_tokens=32 * 640
        )
        ids = [r["id"] for r in rows]
        assert len(ids) == n and len(set(ids)) == n and not any(r["error"] for r in rows)
        assert c.r.info("memory")["used_memory_peak"] < 5 * 2**20


def test_the_release_gate_counts_stored_tokens_and_stored_work_is_not_idle(redis_url, tmp_path):
    """Memory mode: the gate opens at release_batches budgets waiting; tokens in the store count
    (claim.lua), so a backlog mostly in segments is dispatched without waiting for quiet intake."""
    c = _tiered(redis_url, str(tmp_path / "store"), 2000)
    c.set_config("m", {"release_batches": 3, "budget_tokens": 1000, "quiet_ms": 600_000})
    c.submit(_items(60, shapes=1), "j")  # 3,000 tokens: 2,000 in lanes, 1,000 stored
    assert _intake(c)["stored_tokens"] == 1000
    b, why = c.claim(contract(size=8, tokens=1000), "w")
    assert b is not None, why  # 2,000 in lanes alone would keep the gate shut
    c.complete(b, results_for(b))
    while (b := c.claim(contract(size=64, tokens=100_000), "w")[0]) is not None:
        c.complete(b, results_for(b))
    assert c.claim(contract(), "w")[1] == "wait"  # lanes empty, segments waiting: not idle
    inspect = cli("inspect", "m", url=redis_url).stdout.decode()
    assert "in store segments 20 items / 1000 tokens" in inspect


def test_results_past_the_window_move_to_the_store_and_are_read_once(redis_url, tmp_path):
    from conductor.tier.result_segments import offload_job, offload_model

    store = str(tmp_path / "store")
    c = _tiered(redis_url, store, 0)
    c.set_config("m", {"results_window": 50})
    its = _items(300, shapes=1)
    c.submit(its, "j")
    reader = Conductor.from_url(redis_url, store=Store(store))
    follow = reader.results("j", follow=True, block_ms=50, count=40)
    first: list[bytes] = []
    done = 0
    while (b := c.claim(contract(size=32, tokens=100_000), "w")[0]) is not None:
        c.complete(b, results_for(b))
        done += len(b.items)
        if done % 64 == 0:
            first.append(next(follow))  # a following reader, part way, while results move out
        offload_model(c, c.tier.store, "m")
    assert c.r.xlen(MK.job_results("j")) <= 50 and c.r.llen(MK.job_rsegs("j")) > 0
    assert first and c.r.xlen(MK.job_results("j")) + len(first) < 300  # it must read from segments
    rest = list(follow)
    ids = [json.loads(x)["id"] for x in first + rest]
    assert sorted(ids) == sorted(it.id for it in its)  # every id once, across store and Redis
    again = [json.loads(x)["id"] for x in reader.results("j")]  # a fresh reader, from the start
    assert sorted(again) == sorted(it.id for it in its)
    cli_rows = [json.loads(x)["id"] for x in cli("--store", store, "results", "j", url=redis_url).stdout.splitlines()]
    assert cli_rows == again  # the same lines, in the same order
    p = cli("results", "j", url=redis_url, check=False)  # without the store: one clear line
    assert p.returncode != 0 and b"--store" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert offload_job(c.r, c.scripts, c.tier.store, "m", "j", 50) == 0  # nothing more to move
    assert cli("--store", store, "inspect", "m", "--verify", url=redis_url, check=False).returncode == 0


def test_a_cancel_answers_stored_items_and_feeding_runs_none_of_them(redis_url, tmp_path):
    """Items a cancel answers while they wait in store segments are not run when their segment is
    fed back: they leave the stored counters, nothing reaches a worker, every id has one result."""
    from conductor.jobs import job_state
    from conductor.verify import verify

    c = _tiered(redis_url, str(tmp_path / "store"), 1000)
    its = _items(200)
    c.submit(its, "j")
    job_state.start(c.r, "j")
    assert _intake(c)["stored_items"] > 100
    assert job_state.cancel(c, "j")["request_counts"]["failed"] == 200
    got = _run_down(c, Feeder(c, c.tier.store, "m"))
    assert got == []  # nothing ran: every item had its cancelled result already
    st = _intake(c)
    assert (st["tokens"], st["items"], st["stored_tokens"], st["stored_items"]) == (0, 0, 0, 0)
    assert _segments(c) == []
    rows = [json.loads(r) for r in c.results("j")]
    assert sorted(r["id"] for r in rows) == sorted(it.id for it in its)
    assert {r["error"]["code"] for r in rows} == {"cancelled"}
    assert job_state.describe(c, "j")["status"] == "cancelled"
    rep = verify(c.r, "m", items=True)
    assert rep.ok, (rep.drift, rep.problems)
