import json

import pytest
import redis

from conductor.errors import BadInput, QueueFull
from conductor.redis_contract import keys as K
from tests.conftest import CLUSTER, item
from tests.helpers import record, submit_argv


def lanes(c, inst):
    return {int(m): int(s) for m, s in c.r.zrange(K.ModelKeys("m").inst_lanes(inst), 0, -1, withscores=True)}


def inst_of(c, prefix=("sys",)):
    from conductor.formats.signature import shape_signature
    sig = shape_signature(list(prefix))
    ep = int(c.r.hget(K.ModelKeys("m").shape(sig), "epoch"))
    return f"{sig}:{ep}"


def submit_one(c, i, tok, job="j", **kw):
    return c.submit([item(i, tok, **kw)], job)


def test_first_item_opens_lane_and_close_items_join(cdr):
    cdr.set_config("m", {"lane_floor": 8})
    submit_one(cdr, 1, 100)
    submit_one(cdr, 2, 104)  # same 8-token bucket: no padding at all
    submit_one(cdr, 3, 110)  # 8 tokens of padding: at the floor (8), never a new lane
    inst = inst_of(cdr)
    assert lanes(cdr, inst) == {0: 110}  # lanes only grow: rep rose to 110


def test_padding_over_cap_opens_lane(cdr):
    cdr.set_config("m", {"lane_cap": 64, "lane_thr_max": 0.99, "lane_thr_min": 0.99, "lane_depth": 0})
    submit_one(cdr, 1, 1000)
    submit_one(cdr, 2, 1100)  # 100 tokens (9 %) under a 99 % threshold, but over the 64-token cap
    assert sorted(lanes(cdr, inst_of(cdr)).values()) == [1000, 1100]


def test_padding_over_threshold_opens_lane_and_neighbour_that_pads_less_wins(cdr):
    cdr.set_config("m", {"lane_thr_min": 0.05, "lane_depth": 0})
    submit_one(cdr, 1, 100)
    submit_one(cdr, 2, 200)  # 50 % padding: new lane
    assert sorted(lanes(cdr, inst_of(cdr)).values()) == [100, 200]
    submit_one(cdr, 3, 190)  # pads 8 (4 % < 5 %) into the 200 lane, would grow the 100 lane by 88
    ln = lanes(cdr, inst_of(cdr))
    assert sorted(ln.values()) == [100, 200]
    mk = K.ModelKeys("m")
    by_rep = {v: k for k, v in ln.items()}
    assert int(cdr.r.hget(mk.lanemeta(inst_of(cdr), by_rep[200]), "items")) == 2


def test_threshold_rises_as_lane_budget_fills(cdr):
    # Two lanes of four used (50 %): threshold = 0.02 + (0.5 - 0.02) * 0.25 = 14 %.
    cdr.set_config("m", {"lane_max": 4, "lane_thr_min": 0.02, "lane_thr_max": 0.5, "lane_floor": 0,
                         "lane_cap": 100000, "lane_depth": 0})
    submit_one(cdr, 1, 1000)
    submit_one(cdr, 2, 1100)  # 9.4 % > 5 % with one lane of four used: opens
    assert len(lanes(cdr, inst_of(cdr))) == 2
    submit_one(cdr, 3, 1200)  # 8.3 % against 1100: under 14 % now, joins and grows that lane
    ln = lanes(cdr, inst_of(cdr))
    assert sorted(ln.values()) == [1000, 1200]


def test_full_lane_budget_joins_nearest(cdr):
    cdr.set_config("m", {"lane_max": 2, "lane_depth": 0})
    submit_one(cdr, 1, 100)
    submit_one(cdr, 2, 1000)
    submit_one(cdr, 3, 3000)  # would open a lane, budget is full: joins the 1000 lane, which grows
    assert sorted(lanes(cdr, inst_of(cdr)).values()) == [100, 3000]


def test_resubmit_is_idempotent(cdr):
    items = [item(i, 50 + i) for i in range(300)]
    rep = cdr.submit(items[:200], "j")
    assert (rep.accepted, rep.duplicates) == (200, 0)
    rep = cdr.submit(items, "j")  # an interrupted submit re-run: the first 200 are skipped
    assert (rep.accepted, rep.duplicates) == (100, 200)
    assert cdr.status("j")["submitted"] == 300
    assert int(cdr.r.hget(K.ModelKeys("m").intake, "items")) == 300


def _dump(c):
    return {k: c.r.dump(k) for k in sorted(c.r.scan_iter("cdr:{m}:*"))}


B = b'["p", null]'


def test_bad_arguments_write_nothing(cdr):
    cdr.submit([item(1, 10)], "j")
    before = _dump(cdr)
    mk = K.ModelKeys("m")
    S = "0123456789abcdef"
    bad_calls = [  # (ARGV, the field the error names)
        (submit_argv("j", ("x", S, 0, 5)), "input_tokens"),  # zero tokens
        (submit_argv("j", ("x", S, -4, 5)), "input_tokens"),
        (submit_argv("j", ("x", S, "ten", 5)), "input_tokens"),
        (submit_argv("j", ("x", S, 10.5, 5)), "input_tokens"),
        (submit_argv("j", ("x", "nothex", 10, 5)), "sig"),
        (submit_argv("bad job", ("x", S, 10, 5)), "job"),
        (submit_argv("j", ("", S, 10, 5)), "id"),
        (submit_argv("j", (7, S, 10, 5)), "id"),
        (submit_argv("j", ("x", S, 10, 5))[:-1], "argv"),  # count does not match
        (submit_argv("j", ("x", S, 10, 10**12)), "max_tokens"),
        (submit_argv("j", ("x", S, 10, 2_000_000)), "max_tokens"),  # over the 1,048,576 output limit
        (submit_argv("j", ("x", S, 10, 5, b'[3, null]')), "prompt"),
        (submit_argv("j", ("x", S, 10, 5, B, b"{oops")), "prefix"),
        # workers read the record as it is stored: exactly [id, job, tokens, max, prompt(, payload)]
        ([1, "j", S, b"not json", b""], "record"),
        ([1, "j", S, b'{"a": 1}', b""], "record"),
        ([1, "j", S, b' ' + record("x", "j", 10, 5), b""], "record"),
        ([1, "j", S, record("x", "j", 10, 5, b'["p", 1, 2]'), b""], "record"),
        ([1, "j", S, b'["x", "j", 10, 5]', b""], "record"),
        ([1, "j", S, record("x", "other", 10, 5), b""], "job"),  # the record names another job
        # a good item followed by a bad one: all or nothing
        (submit_argv("j", ("y", S, 10, 5), ("z", S, 10, 0)), "max_tokens"),
        # the producer's content sums, 16 lowercase hex digits per item
        ([*submit_argv("j", ("x", S, 10, 5)), "abc"], "sums"),
        ([*submit_argv("j", ("x", S, 10, 5)), "Z" * 16], "sums"),
        ([*submit_argv("j", ("x", S, 10, 5), ("y", S, 10, 5)), S], "sums"),
    ]
    for args, field in bad_calls:
        with pytest.raises(Exception, match=f"^ERR_ARG {field}"):
            cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=args)
    assert _dump(cdr) == before


def test_full_queue_is_a_typed_error_and_writes_nothing(cdr):
    cdr.set_config("m", {"max_waiting_tokens": 1000})
    cdr.submit([item(i, 100) for i in range(8)], "j")
    before = _dump(cdr)
    with pytest.raises(QueueFull, match="ceiling"):
        cdr.submit([item(i, 100) for i in range(8, 11)], "j")
    assert _dump(cdr) == before


def test_script_errors_name_the_field(cdr):
    mk = K.ModelKeys("m")
    cdr.ensure_model("m")
    from conductor.redis_contract.script_calls import raise_script_error as _raise_script_error
    with pytest.raises(redis.ResponseError) as e:
        cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=submit_argv("j", ("x", "0" * 16, 0, 5)))
    with pytest.raises(BadInput) as ei:
        _raise_script_error(e.value)
    assert ei.value.field == "input_tokens"


def test_prefix_is_stored_once_per_shape(cdr):
    cdr.submit([item(i, 40, prefix=("big system prompt", "shots")) for i in range(50)], "j")
    from conductor.formats.signature import shape_signature
    sig = shape_signature(["big system prompt", "shots"])
    assert cdr.prefix("m", sig) == ["big system prompt", "shots"]
    # item records carry only the prompt and payload, the prefix lives once in the shape record
    inst = inst_of(cdr, ("big system prompt", "shots"))
    mk = K.ModelKeys("m")
    recs = cdr.r.lrange(mk.lane(inst, 0), 0, -1)
    assert recs and all(b"big system prompt" not in rec for rec in recs)
    # a record is the JSON array [id, job, input_tokens, max_tokens, prompt, payload], and the
    # lane's token list holds the same tokens in the same order
    first = json.loads(recs[0])
    assert first[:4] == [first[0], "j", 40, first[3]] and len(first) == 6
    assert [int(t) for t in cdr.r.lrange(mk.lane_tok(inst, 0), 0, -1)] == [json.loads(r)[2] for r in recs]


def test_bulk_submit_groups_shapes_and_keeps_arrival_order_within_each(cdr):
    from conductor.client.submit_stream import grouped_by_shape as _grouped_by_shape
    shapes = [("a",), ("b",), ("c",)]
    its = [item(i, 40, prefix=shapes[i % 3]) for i in range(3000)]  # interleaved, three calls' worth
    grouped = _grouped_by_shape(its)
    assert sorted(it.id for it in grouped) == sorted(it.id for it in its)
    # shapes in order of first appearance, each shape's items in arrival order
    assert [it.sig for it in grouped[::1000]] == [its[0].sig, its[1].sig, its[2].sig]
    assert [int(it.id) for it in grouped[:1000]] == list(range(0, 3000, 3))
    rep = cdr.submit(its, "j")
    assert rep.accepted == 3000
    for k, prefix in enumerate(shapes):
        inst = inst_of(cdr, prefix)
        recs = cdr.r.lrange(K.ModelKeys("m").lane(inst, 0), 0, -1)
        assert [int(json.loads(r)[0]) for r in recs] == list(range(k, 3000, 3))


def test_a_record_only_the_lenient_decoder_reads_still_reaches_the_worker(cdr):
    # submit.lua checks bodies with cjson, which also takes NaN; msgspec refuses it, so the claim
    # decodes that batch record by record and the item arrives with its payload
    import math

    from conductor.redis_contract.records import Contract
    mk = K.ModelKeys("m")
    cdr.ensure_model("m")
    cdr.set_config("m", {"release_batches": 0, "activate_batches": 0, "quiet_ms": 0})
    cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=submit_argv(
        "j", ("a", "0123456789abcdef", 10, 5, b'["p", NaN]'), ("b", "0123456789abcdef", 10, 5)))
    b, why = cdr.claim(Contract(model="m", max_batch_size=8, max_batch_tokens=800, max_input_len=100), "w")
    assert b is not None, why
    assert [it.id for it in b.items] == ["a", "b"]
    assert math.isnan(b.items[0].payload) and b.items[1].prompt == "p"


def test_a_record_whose_head_only_cjson_reads_is_handed_out_answerable(cdr):
    # A producer wrote the numbers in forms cjson (submit.lua's check) takes and JSON does not:
    # the item still reaches the worker with its id, job and tokens, marked unreadable, and the
    # rest of its batch decodes as usual.
    from conductor.redis_contract.records import Contract
    mk = K.ModelKeys("m")
    cdr.ensure_model("m")
    cdr.set_config("m", {"release_batches": 0, "activate_batches": 0, "quiet_ms": 0})
    sig = "0123456789abcdef"
    cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=[
        2, "j", sig, b'["h", "j", 010, 0x5, "p", 0x10]', b"[]", sig, record("ok", "j", 10, 5), b""])
    b, why = cdr.claim(Contract(model="m", max_batch_size=8, max_batch_tokens=800, max_input_len=100), "w")
    assert b is not None, why
    odd, ok = b.items
    assert (odd.id, odd.job, odd.input_tokens, odd.max_tokens) == ("h", "j", 10, 5)
    assert odd.unreadable and not ok.unreadable and ok.prompt == "p"


def test_a_producer_following_the_readme_protocol_with_raw_commands(cdr):
    # docs/formats.md, "Submitting from another language", step by step, with no conductor code on the
    # producer side: the items are claimed, completed and counted like any others.
    import hashlib
    import time

    from conductor.formats.signature import shape_signature
    from conductor.redis_contract.scripts import source
    from tests.helpers import drain
    r = cdr.r
    text = source("submit")
    sha = r.script_load(text)
    assert sha == hashlib.sha1(text.encode()).hexdigest()
    for name, value in {"quiet_ms": 50, "release_batches": 0, "activate_batches": 0}.items():
        r.hsetnx("cdr:{ext}:cfg", name, value)
    r.sadd("cdr:models", "ext")
    r.execute_command("XGROUP", "CREATE", "cdr:{ext}:batches", "workers", "$", "MKSTREAM")
    r.zadd("cdr:jobs", {"xj": int(time.time() * 1000)}, nx=True)
    r.sadd("cdr:job:xj:models", "ext")
    sig = shape_signature(["system prompt"])
    args = []
    for i in range(30):
        rec = json.dumps([f"x{i}", "xj", 20 + i, 8, f"prompt {i}", {"k": i}], separators=(",", ":"))
        args += [sig, rec, json.dumps(["system prompt"]) if i == 0 else ""]
    keys = ["cdr:{ext}", "cdr:{ext}:cfg", "cdr:{ext}:state"]
    lanes = r.evalsha(sha, 3, *keys, 30, "xj", *args)
    assert len(lanes) == 30 and -1 not in lanes
    assert r.evalsha(sha, 3, *keys, 30, "xj", *args) == [-1] * 30  # re-sent: nothing doubled
    from conductor.redis_contract.records import Contract
    batches = drain(cdr, Contract(model="ext", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096))
    items = [it for b in batches for it in b.items]
    assert sorted(it.id for it in items) == sorted(f"x{i}" for i in range(30))
    assert {tuple(b.prefix) for b in batches} == {("system prompt",)}
    assert items[0].payload == {"k": int(items[0].id[1:])}
    st = cdr.status("xj")
    assert (st["submitted"], st["completed"], st["pending"]) == (30, 30, 0)


def _everything(r) -> dict:
    return {k: r.dump(k) for k in r.scan_iter(count=1000)}


@pytest.mark.parametrize("prefix", [b'{"a":1}', b'[1,2,{"x":null}]', json.dumps(["c"] * 257).encode(),
                                    json.dumps(["c"] * 300).encode(), b'[["nested"]]', b'[null]', b'"sys"',
                                    b'{}', b'[', b'[true]', b""])
def test_submit_refuses_a_prefix_the_edge_refuses(cdr, prefix):
    """Issue 13: a prefix that is no list of at most 256 strings (or none, for a new signature)
    broke every worker's admit with AttributeError; submit.lua refuses it as conductor/formats/native.py does."""
    mk = K.ModelKeys("m")
    cdr.ensure_model("m")
    before = _everything(cdr.r)
    with pytest.raises(redis.ResponseError, match="ERR_ARG prefix"):
        cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state],
                           args=submit_argv("j", ("x", "0123456789abcdef", 10, 5, b'["p", null]', prefix)))
    assert _everything(cdr.r) == before


def test_submit_prefix_rules_it_keeps(cdr):
    from conductor.redis_contract.records import Contract
    mk = K.ModelKeys("m")
    cdr.ensure_model("m")
    cdr.set_config("m", {"release_batches": 0, "activate_batches": 0, "quiet_ms": 0})
    s1, s2 = "0123456789abcdef", "fedcba9876543210"
    parts = json.dumps([f"part {i}" for i in range(256)]).encode()
    run = cdr.scripts.submit
    # 256 components; the prefix on a later item of the call; [] (no cacheable parts)
    assert run(keys=[mk.base, mk.cfg, mk.state], args=submit_argv(
        "j", ("a", s1, 10, 5, b'["p", null]', parts), ("b", s2, 10, 5, b'["p", null]', b""),
        ("c", s2, 10, 5, b'["p", null]', b' ["x", ""]'))) == [0, 0, 0]
    # known signatures come without it
    assert run(keys=[mk.base, mk.cfg, mk.state], args=submit_argv(
        "j", ("d", s1, 10, 5, b'["p", null]', b""), ("e", s2, 10, 5, b'["p", null]', b""))) == [0, 0]
    assert cdr.prefix("m", s1) == [f"part {i}" for i in range(256)] and cdr.prefix("m", s2) == ["x", ""]
    # an id of the job sent again under another signature is another item: refused, nothing written
    s3 = "00000000000000aa"
    with pytest.raises(redis.ResponseError, match="CONFLICT 1"):
        run(keys=[mk.base, mk.cfg, mk.state], args=submit_argv(
            "j", ("a", s3, 10, 5, b'["p", null]', b'["y"]'), ("f", s3, 10, 5, b'["p", null]', b"")))
    assert not cdr.r.exists(mk.shape(s3))
    b, _ = cdr.claim(Contract(model="m", max_batch_size=8, max_batch_tokens=800, max_input_len=100), "w")
    assert b.prefix in ([f"part {i}" for i in range(256)], ["x", ""])


def test_depth_rule_gives_a_shallow_shape_few_lanes_and_a_deep_one_more(cdr):
    import math
    # Reference budget 2,000 tokens / 8 items, one lane per full batch; the lengths are spread
    # wide enough that, without the rule, every item opens its own lane.
    cdr.set_config("m", {"budget_tokens": 2000, "budget_items": 8, "lane_depth": 1, "lane_thr_min": 0.01,
                         "lane_thr_max": 0.01})
    shallow = [100, 500, 900, 1300]  # 2,800 tokens: 1.4 budgets
    cdr.submit([item(f"s{i}", t, prefix=("shallow",)) for i, t in enumerate(shallow)], "j")
    assert len(lanes(cdr, inst_of(cdr, ("shallow",)))) == 2
    deep = [100 + (i * 61) % 1400 for i in range(24)]
    cdr.submit([item(f"d{i}", t, prefix=("deep",)) for i, t in enumerate(deep)], "j")
    assert len(lanes(cdr, inst_of(cdr, ("deep",)))) == math.ceil(max(sum(deep) / 2000, 24 / 8)) == 9
    cdr.set_config("m", {"lane_depth": 0})  # the rule lifted: padding alone decides
    cdr.submit([item(f"u{i}", t, prefix=("free",)) for i, t in enumerate(shallow)], "j")
    assert len(lanes(cdr, inst_of(cdr, ("free",)))) == 4


def test_depth_rule_counts_the_calls_own_items_before_placing_the_first(cdr):
    # One call of 40 items of one shape: the first item already sees 5 budgets (items), so the
    # lanes open as the lengths ask, up to 5; item by item the shape would have stayed at one.
    cdr.set_config("m", {"budget_tokens": 1_000_000, "budget_items": 8, "lane_depth": 1,
                         "lane_thr_min": 0.01, "lane_thr_max": 0.01})
    cdr.submit([item(f"a{i}", 100 + 200 * (i % 5)) for i in range(40)], "j")
    assert len(lanes(cdr, inst_of(cdr))) == 5
    cdr.submit([item(f"b{i}", 100 + 200 * (i % 5), prefix=("other",)) for i in range(3)], "j")
    assert len(lanes(cdr, inst_of(cdr, ("other",)))) == 1


def test_the_sums_a_producer_sends_are_the_ones_submit_lua_would_compute(cdr):
    from conductor.redis_contract.script_calls import submit_args
    its = [item(f"s{i}", 10 + i, prefix=(f"P{i % 3}",), payload={"k": i}) for i in range(20)]
    args = submit_args("j", its)
    assert len(args) == 3 + 3 * len(its)  # the sums ride last
    cdr.ensure_model("m2")
    sent, computed = K.ModelKeys("m"), K.ModelKeys("m2")
    cdr.scripts.submit(keys=[sent.base, sent.cfg, sent.state], args=args)
    cdr.scripts.submit(keys=[computed.base, computed.cfg, computed.state], args=args[:-1])  # Redis's SHA-1
    reg = cdr.r.hgetall(sent.job_sums("j"))
    assert len(reg) == 20 and reg == cdr.r.hgetall(computed.job_sums("j"))
    # and a re-sent item with other content is still a conflict, judged by the sent sums
    changed = [item("s0", 99, prefix=("P0",))]
    with pytest.raises(Exception, match="^CONFLICT 1"):
        cdr.scripts.submit(keys=[sent.base, sent.cfg, sent.state], args=submit_args("j", changed))


def _calls(r, *cmds):
    st = r.info("commandstats")
    return {c: st.get(f"cmdstat_{c}", {}).get("calls", 0) for c in cmds}


@pytest.mark.skipif(CLUSTER, reason="INFO commandstats of one server")
def test_a_call_opening_many_lanes_asks_for_lane_ids_once(cdr):
    # Every item opens its own lane (no depth rule, any padding opens one): the free set is asked
    # once (it stays empty through the call), lane_seq read once and moved once, and a lane the call
    # opened has no hash to read. Per lane before: SPOP, HINCRBY lane_seq and HMGET of its meta.
    cdr.set_config("m", {"lane_depth": 0, "lane_thr_min": 0.001, "lane_thr_max": 0.001, "lane_floor": 0,
                         "lane_cap": 1, "lane_max": 64})
    toks = [100 + 64 * i for i in range(12)]
    submit_one(cdr, "first", 5000)  # the shape exists: its instance and lane 0
    cdr.r.config_resetstat()
    cdr.submit([item(f"a{i}", t) for i, t in enumerate(toks)], "j")
    calls = _calls(cdr.r, "spop", "hincrby", "hmget", "rpush")
    inst = inst_of(cdr)
    assert sorted(lanes(cdr, inst)) == list(range(13))
    mk = K.ModelKeys("m")
    assert cdr.r.hget(mk.inst(inst), "lane_seq") == b"13"
    assert calls["rpush"] == 2 * 12  # 12 lanes touched
    assert calls["spop"] == 1
    assert calls["hincrby"] < 12
    assert calls["hmget"] < 12
    for lane, t in zip(range(1, 13), toks, strict=True):
        meta = cdr.r.hgetall(mk.lanemeta(inst, lane))
        assert {k: meta[k] for k in (b"items", b"tokens", b"rep")} == {b"items": b"1", b"tokens": str(t).encode(),
                                                                     b"rep": str(t).encode()}
        assert meta[b"since_ms"] == meta[b"last_ms"]
