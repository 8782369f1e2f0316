"""Bad input, thrown by hypothesis at the Lua scripts directly and at parse_line: every
malformed argument gets 'ERR_ARG <field>' (BadInput at the edge) and the model's keys are
byte for byte what they were (DUMP of every cdr:{m}:* key before and after)."""

import json
import re

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conductor.errors import BadInput
from conductor.formats.lines import parse_line
from conductor.redis_contract.records import Contract, PreparedItem
from tests.conftest import item
from tests.helpers import MK, quick, submit_argv

SETTINGS = settings(max_examples=50, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TEN_MB = "x" * (10 * 1024 * 1024)
GOOD_SIG = "0123456789abcdef"


def model_dump(r) -> dict[bytes, bytes]:
    return {k: r.dump(k) for k in r.scan_iter(match="cdr:{m}:*", count=1000)}


@pytest.fixture()
def busy(cdr):
    """A model with waiting items, a batch in flight, a result and a dead-letter entry."""
    quick(cdr, max_deliveries=1)
    cdr.submit([item(i, 10 + i % 40, prefix=(f"s{i % 2}",)) for i in range(200)], "j")
    c = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)
    b, _ = cdr.claim(c, "dead")
    cdr.reclaim_dead("m")
    b, _ = cdr.claim(c, "w")
    return cdr, b


# Values no integer check may pass, in the forms redis-py sends: ints, floats, str and bytes.
def not_an_int_in(lo: int, hi: int) -> st.SearchStrategy:
    return st.one_of(
        st.integers(max_value=lo - 1, min_value=-(10 ** 30)),
        st.integers(min_value=hi + 1, max_value=10 ** 30),
        st.floats(min_value=lo, max_value=hi).filter(lambda f: not f.is_integer()),
        st.sampled_from(["", " ", "abc", "1,5", "--1", "½", "１２", "🙂", "12abc", "9" * 400, "-9" * 200,
                         "nan", "inf", "-inf", "1e400", b"\x00", b"\xff\xfe", "0x", "1e"]),
        st.text(alphabet="ghjklmopqrsuvwyzGHJKLMOPQRSUVWYZ!?@ _ü日", min_size=1, max_size=12),
    )


def bad_name(max_len: int = 128) -> st.SearchStrategy:
    ok = re.compile(r"^[A-Za-z0-9._/@+=-]{1,%s}$" % str(max_len))  # noqa: UP031 - braces in the regex
    return st.one_of(st.just(""), st.just("j" * (max_len + 1)),
                     st.text(min_size=1, max_size=40).filter(lambda s: not ok.match(s)))


def oversized(limit: int) -> st.SearchStrategy:
    return st.one_of(st.just(""), st.integers(limit + 1, limit + 5000).map(lambda n: "i" * n))


def call_expecting(cdr, script, keys, args, field: str) -> None:
    before = model_dump(cdr.r)
    with pytest.raises(redis.ResponseError) as e:
        script(keys=keys, args=args)
    assert str(e.value).startswith(f"ERR_ARG {field}"), str(e.value)[:200]
    assert model_dump(cdr.r) == before


# Values go into submit.lua's ARGV as the client sends them: job as its own argument, id,
# input_tokens and max_tokens as JSON inside the item record (bytes as latin-1 text).
SUBMIT_FIELDS = {"job": bad_name(), "id": oversized(512),
                 "sig": st.text(max_size=20).filter(lambda s: not re.fullmatch("[0-9a-f]{16}", s)),
                 "input_tokens": not_an_int_in(1, 16_777_216), "max_tokens": not_an_int_in(1, 16_777_216)}
SUBMIT_ORDER = ["job", "id", "sig", "input_tokens", "max_tokens"]


def _text(v):
    return v.decode("latin-1") if isinstance(v, bytes) else v


@SETTINGS
@given(data=st.data())
def test_submit_lua_refuses_each_malformed_field_and_writes_nothing(busy, data):
    cdr, _ = busy
    n = data.draw(st.integers(1, 3))
    rows = [[f"new{k}", GOOD_SIG, 10, 5, b'["p", null]', b'["s"]'] for k in range(n)]
    job = "j"
    field = data.draw(st.sampled_from(SUBMIT_ORDER))
    bad = _text(data.draw(SUBMIT_FIELDS[field]))
    if field == "job":
        job = bad
    else:
        rows[data.draw(st.integers(0, n - 1))][SUBMIT_ORDER.index(field) - 1] = bad
    call_expecting(cdr, cdr.scripts.submit, [MK.base, MK.cfg, MK.state], submit_argv(job, *rows), field)


@SETTINGS
@given(n=not_an_int_in(1, 5000), extra=st.sampled_from([0, 1, 2, 4]))  # 3 would be a second item
def test_submit_lua_refuses_a_bad_count(busy, n, extra):
    cdr, _ = busy
    call_expecting(cdr, cdr.scripts.submit, [MK.base, MK.cfg, MK.state], [n, "j"] + ["x"] * extra, "n")
    args = submit_argv("j", ("a", GOOD_SIG, 1, 1)) + ["x"] * extra
    args[0] = 2  # one item's arguments (and a few more) under a count of two
    # 3 + 3n arguments read as n items and their content sums (submit.lua ARGV[3+3n]): the junk
    # in the sums' place is what is named then
    call_expecting(cdr, cdr.scripts.submit, [MK.base, MK.cfg, MK.state], args,
                   "sums" if len(args) == 3 + 3 * 2 else "argv")


CLAIM_FIELDS = {"consumer": oversized(200), "max_batch_size": not_an_int_in(1, 65536),
                "max_batch_tokens": not_an_int_in(1, 1073741824)}


@SETTINGS
@given(data=st.data())
def test_claim_lua_refuses_each_malformed_field_and_writes_nothing(busy, data):
    cdr, _ = busy
    args = ["w2", 8, 1024, 4096]
    field = data.draw(st.sampled_from(sorted(CLAIM_FIELDS)))
    args[["consumer", "max_batch_size", "max_batch_tokens"].index(field)] = data.draw(CLAIM_FIELDS[field])
    call_expecting(cdr, cdr.scripts.claim, [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed], args, field)


COMPLETE_FIELDS = {"batch_id": st.one_of(st.just(""), st.text(max_size=30).filter(
                       lambda s: not re.fullmatch(r"\d+-\d+", s))),
                   "final": st.text(max_size=3).filter(lambda s: s not in ("0", "1")),
                   "job": bad_name(), "id": oversized(512),
                   "status": st.text(max_size=5).filter(lambda s: s not in ("ok", "err"))}


@SETTINGS
@given(data=st.data())
def test_complete_lua_refuses_each_malformed_field_and_writes_nothing(busy, data):
    cdr, b = busy
    results = [[it.job, it.id, "ok", json.dumps({"id": it.id})] for it in b.items]
    head = [b.batch_id, 1, len(results)]
    field = data.draw(st.sampled_from(sorted(COMPLETE_FIELDS)))
    bad = data.draw(COMPLETE_FIELDS[field])
    if field in ("batch_id", "final"):
        head[0 if field == "batch_id" else 1] = bad
    else:
        results[data.draw(st.integers(0, len(results) - 1))][["job", "id", "status"].index(field)] = bad
    call_expecting(cdr, cdr.scripts.complete, [MK.base, MK.state, MK.batches], head + sum(results, []), field)


@SETTINGS
@given(n=not_an_int_in(0, 65536))
def test_complete_lua_refuses_a_bad_count(busy, n):
    cdr, b = busy
    call_expecting(cdr, cdr.scripts.complete, [MK.base, MK.state, MK.batches], [b.batch_id, 1, n], "n")


RECLAIM_FIELDS = {"consumer": oversized(200), "force": st.text(max_size=3).filter(lambda s: s not in ("0", "1")),
                  "min_idle_ms": not_an_int_in(0, 10 ** 15), "count": not_an_int_in(1, 1000)}


@SETTINGS
@given(data=st.data())
def test_reclaim_lua_refuses_each_malformed_field_and_writes_nothing(busy, data):
    cdr, _ = busy
    args = ["w", 1, 0, 10]  # forced: would move w's batch if the call went through
    field = data.draw(st.sampled_from(sorted(RECLAIM_FIELDS)))
    args[["consumer", "force", "min_idle_ms", "count"].index(field)] = data.draw(RECLAIM_FIELDS[field])
    call_expecting(cdr, cdr.scripts.reclaim, [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed], args, field)


@SETTINGS
@given(data=st.data())
def test_fail_lua_refuses_each_malformed_field_and_writes_nothing(busy, data):
    cdr, b = busy
    args = [b.batch_id, "w", "boom"]
    field = data.draw(st.sampled_from(["batch_id", "consumer"]))
    bad = data.draw(COMPLETE_FIELDS["batch_id"] if field == "batch_id" else oversized(200))
    args[0 if field == "batch_id" else 1] = bad
    call_expecting(cdr, cdr.scripts.fail, [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed], args, field)


def test_ten_megabyte_fields_are_refused_by_name(busy):
    cdr, b = busy
    keys5 = [MK.base, MK.cfg, MK.state, MK.batches, MK.reclaimed]
    call_expecting(cdr, cdr.scripts.submit, [MK.base, MK.cfg, MK.state],
                   submit_argv("j", (TEN_MB[:9 * 1024 * 1024], GOOD_SIG, 10, 5)), "record")
    call_expecting(cdr, cdr.scripts.submit, [MK.base, MK.cfg, MK.state],
                   submit_argv("j", (TEN_MB[:8 * 1024 * 1024 - 100], GOOD_SIG, 10, 5)), "id")
    call_expecting(cdr, cdr.scripts.submit, [MK.base, MK.cfg, MK.state],
                   submit_argv(TEN_MB, ("a", GOOD_SIG, 10, 5)), "job")
    call_expecting(cdr, cdr.scripts.claim, keys5, [TEN_MB, 8, 1024, 4096], "consumer")
    call_expecting(cdr, cdr.scripts.complete, [MK.base, MK.state, MK.batches],
                   [b.batch_id, 1, 1, "j", TEN_MB, "ok", "{}"], "id")
    call_expecting(cdr, cdr.scripts.reclaim, keys5, [TEN_MB, 1, 0, 10], "consumer")
    call_expecting(cdr, cdr.scripts.fail, keys5, [b.batch_id, TEN_MB, "boom"], "consumer")
    with pytest.raises(BadInput) as e:
        parse_line(json.dumps({"id": "a", "model": "m", "prompt": TEN_MB, "max_tokens": 1}))
    assert e.value.field == "line"
    with pytest.raises(BadInput) as e:
        parse_line(json.dumps({"id": "a", "model": "m", "prompt": "p", "max_tokens": 1, "payload": "y" * 2_000_000}))
    assert e.value.field == "payload"


def test_a_bad_model_or_job_name_at_the_api_writes_nothing(cdr):
    before = {k: cdr.r.dump(k) for k in cdr.r.scan_iter(match="cdr:*")}
    good = item(1, 10)
    wrong_model = PreparedItem(id="1", model="no such{model}", sig=good.sig, input_tokens=10, max_tokens=5,
                               body=good.body, prefix=good.prefix)
    with pytest.raises(BadInput) as e:
        cdr.submit([good, wrong_model], "j")
    assert e.value.field == "model"
    with pytest.raises(BadInput) as e:
        cdr.submit([good], "bad job")
    assert e.value.field == "job"
    assert {k: cdr.r.dump(k) for k in cdr.r.scan_iter(match="cdr:*")} == before


json_values = st.recursive(st.none() | st.booleans() | st.integers(-(10 ** 20), 10 ** 20) | st.floats()
                           | st.text(max_size=30), lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
native_keys = st.sampled_from(["id", "model", "prefix", "prompt", "input_tokens", "max_tokens", "payload",
                               "custom_id", "body", "method", "url", "extra"])


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(obj=st.dictionaries(native_keys, json_values, max_size=7))
def test_parse_line_gives_an_item_or_badinput_naming_a_field(obj):
    try:
        line = json.dumps(obj)
    except ValueError:
        return  # NaN is not JSON
    try:
        it = parse_line(line, 7)
    except BadInput as e:
        assert e.field and e.line == 7 and str(e).startswith(f"line 7: {e.field}")
        return
    assert isinstance(it, PreparedItem) and 1 <= it.input_tokens and 1 <= it.max_tokens
    assert re.fullmatch("[0-9a-f]{16}", it.sig)


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_parse_line_on_arbitrary_bytes_never_raises_anything_but_badinput(raw):
    try:
        parse_line(raw)
    except BadInput as e:
        assert e.field


@SETTINGS
@given(data=st.data())
def test_maintenance_scripts_refuse_malformed_arguments_and_write_nothing(busy, data):
    from conductor.redis_contract.scripts import source
    cdr, _ = busy
    which = data.draw(st.sampled_from(["trim", "trim_results", "dead_retry"]))
    script = cdr.r.register_script(source(which))
    if which == "trim":
        call_expecting(cdr, script, [MK.batches, MK.finished], [data.draw(not_an_int_in(0, 10_000_000))],
                       "finished_keep")
    elif which == "trim_results":
        call_expecting(cdr, script, [MK.job_intake("j"), MK.job("j"), MK.job_results("j")],
                       [data.draw(not_an_int_in(0, 253402300799999))], "before_ms")
    else:
        entry = cdr.r.xrange(MK.dead)[0][0].decode()
        bad = data.draw(st.one_of(st.just(""), st.text(max_size=30).filter(lambda s: not re.fullmatch(r"\d+-\d+", s))))
        call_expecting(cdr, script, [MK.base, MK.state, MK.dead, MK.reclaimed], [entry, bad], "ids")
