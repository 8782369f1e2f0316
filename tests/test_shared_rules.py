"""Each rule Lua and Python share has one source (issue 34): conductor/redis_contract/rules.py for
names, limits and the request-reply keys, config.py for defaults, records.Result for the result
record's layout. lib_generated.lua carries them into the scripts as loaded; these tests fail when a
file of lua/ spells one of them by hand, or when the loaded Lua and Python part."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
import redis

from conductor.client import request
from conductor.formats import checks, openai_input
from conductor.redis_contract import config, keys, records, rules, scripts
from conductor.redis_contract.records import Result, ResultError, json_encoder
from conductor.redis_contract.scripts import expand
from tests.conftest import ROOT

LUA = ROOT / "lua"

# Another rule that happens to share a value with one of rules.py's: (file, value) -> why.
SAME_VALUE_OTHER_RULE = {
    ("offload_results.lua", 4096): "a result segment's index record, not a failure reason",
    ("register.lua", 4096): "a worker's contract JSON, not a failure reason",
    ("intake_create.lua", 4096): "an intake task's text field, not a failure reason",
    ("ensure_model.lua", 128): "config arguments (names and values), not a name's length",
    ("lib_repair_items.lua", 256): "items per reclaimed entry, not prefix strings",
}


def _code(text: str) -> str:
    """A Lua file without its comments (no string of lua/ holds '--')."""
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def _eval(r: redis.Redis, body: str, *args: object) -> object:
    text = expand("t.lua", lambda f: "--@include lib.lua\n" + body if f == "t.lua" else scripts._read(f))
    return r.eval(text, 0, *args)


def test_no_lua_file_spells_a_shared_rule():
    assert "RULES.SEGMENT_PARTS" in (LUA / "lib_serve.lua").read_text()
    result_keys = [f.encode_name for f in msgspec.structs.fields(Result)]
    found = []
    for p in sorted(LUA.glob("*.lua")):
        code = _code(p.read_text())
        for name, value in rules.LUA_RULES.items():
            # common numbers: hand-written checks are found below; SEGMENT_PARTS (4) is in every script
            # as something else, and lib_serve.lua reads RULES.SEGMENT_PARTS (asserted after the loop)
            if name.endswith("_HEX") or name in ("TOKEN_MAX", "SEGMENT_PARTS"):
                continue
            if isinstance(value, int):
                # a number as such: not a byte escape (\128) nor part of a longer number
                hit = re.search(rf"(?<![\\\w.]){value}(?![\w.])", code)
                if hit and (p.name, value) not in SAME_VALUE_OTHER_RULE:
                    found.append(f"{p.name}: {name} ({value})")
            elif f"'{value}'" in code or f'"{value}"' in code:
                found.append(f"{p.name}: {name} ({value!r})")
        if "[0-9a-f]+$'" in code or "'^%x+$'" in code:  # a hex string of a set length, checked by hand
            found.append(f"{p.name}: a hex check (hex_ok and RULES' *_HEX)")
        if any(f"'{c}'" in code for c in rules.END_CODES):
            found.append(f"{p.name}: an early end's code (end_code_ok)")
        if "%w%._-" in code:  # the batch token's characters
            found.append(f"{p.name}: the token pattern (token_ok)")
        if "@+=" in code:  # the name characters
            found.append(f"{p.name}: the name pattern")
        # a result record built or read by hand: its JSON keys, quoted as a record holds them
        if any(f'"{k}":' in code or f'\'"{k}"' in code for k in result_keys if k not in ("id", "job")):
            found.append(f"{p.name}: a result record's field")
    assert not found, found


def test_python_takes_the_rules_from_their_one_source():
    assert checks.MAX_ID_BYTES is rules.MAX_ID_BYTES
    assert (checks.MAX_INPUT_TOKENS, checks.MAX_OUTPUT_TOKENS, checks.MAX_PREFIX_PARTS) == (
        rules.MAX_INPUT_TOKENS, rules.MAX_OUTPUT_TOKENS, rules.MAX_PREFIX_PARTS)
    assert openai_input.DEFAULT_MAX_TOKENS is rules.DEFAULT_MAX_TOKENS is config.DEFAULTS["default_max_tokens"]
    assert keys.REQUEST_JOB_PREFIX is rules.REQUEST_JOB_PREFIX
    assert request.REPLY_TTL_MS is rules.REPLY_TTL_MS
    literals = {"16_777_216", "1_048_576", "60_000", '"rq."', "A-Za-z0-9._/@+=-"}
    files = [p for folder in ("conductor", "workers") for p in (ROOT / folder).rglob("*.py") if p.name != "rules.py"]
    found = [f"{p.relative_to(ROOT)}: {lit}" for p in files for lit in literals if lit in p.read_text()]
    assert not found, found


def test_the_loaded_lua_holds_rules_py(redis_url):
    r = redis.Redis.from_url(redis_url)
    assert json.loads(_eval(r, "return cjson.encode(RULES)")) == rules.LUA_RULES


NAMES = ["m", "a" * 128, "a" * 129, "", "Llama-3.1/8B@v2+x=y_z.q", "a b", "a:b", "{m}", "é", "a\nb", "a*", "a%", "-",
         "..", "a]", "a^", "[", "a$", "0"]


def test_lua_and_python_take_the_same_names(redis_url):
    r = redis.Redis.from_url(redis_url)
    lua = json.loads(_eval(r, "local out = {} for i, v in ipairs(ARGV) do out[i] = name_ok(v) end "
                              "return cjson.encode(out)", *NAMES))
    python = []
    for n in NAMES:
        try:
            keys.check_name("name", n)
            python.append(True)
        except ValueError:
            python.append(False)
    assert lua == python


RESULTS = [
    Result(id="i1", model="m", job="j", output="out \"quoted\" \\ \n", output_tokens=7, error=None, shape="ab" * 8,
           epoch=3, lane=2, batch="1700000000000-0", batch_size=4, batch_padded_len=16, input_tokens=9, worker="w",
           claimed_at=1700000000000, finished_at=1700000000123, deliveries=2, payload={"k": [1, "x"]}),
    Result(id="i2", model="m", job="j", output="", output_tokens=0, error=ResultError("dead_letter", "why \\ \"x\""),
           shape="", epoch=0, lane=0, batch="", batch_size=0, batch_padded_len=0, input_tokens=0, worker="",
           claimed_at=0, finished_at=5, deliveries=0, payload=None),
]


ODD = msgspec.structs.replace(RESULTS[0], id="a/b", job="j/k", output="/ é \x01 \u2028")


@pytest.mark.parametrize("res", [*RESULTS, ODD], ids=["ok", "error", "odd"])
def test_the_lua_result_record_is_the_python_one(redis_url, res):
    r = redis.Redis.from_url(redis_url)
    fields = {f: getattr(res, f) for f in res.__struct_fields__}
    fields["error"] = msgspec.structs.asdict(res.error) if res.error else None
    fields["payload"] = json_encoder.encode(res.payload).decode()  # the script keeps its producer's JSON text
    built = _eval(r, "local r = cjson.decode(ARGV[1]) if r.error == cjson.null then r.error = nil end "
                     "return result_record(r)", json.dumps(fields))
    assert records.result_decoder.decode(built) == res
    if res is not ODD:  # cjson writes '/' as '\/' (and json_str sends such strings to cjson): the same JSON
        assert built == json_encoder.encode(res)


def test_lua_reads_the_whole_numbers_of_a_python_result(redis_url):
    r = redis.Redis.from_url(redis_url)
    rec = json_encoder.encode(RESULTS[0])
    ints = [f for f in RESULTS[0].__struct_fields__ if type(getattr(RESULTS[0], f)) is int]
    got = json.loads(_eval(r, "local out = {} for i = 2, #ARGV do out[ARGV[i]] = result_int(ARGV[1], ARGV[i]) end "
                              "return cjson.encode(out)", rec, *ints))
    assert got == {f: getattr(RESULTS[0], f) for f in ints}
    # a field's name and a number inside the output text are escaped there: the plain find skips them
    tricky = msgspec.structs.replace(RESULTS[0], output=',"output_tokens":999,"batch_padded_len":5')
    got = json.loads(_eval(r, "return cjson.encode({(result_int(ARGV[1], 'output_tokens')), "
                              "(result_int(ARGV[1], 'batch_padded_len'))})", json_encoder.encode(tricky)))
    assert got == [tricky.output_tokens, tricky.batch_padded_len]
    # a later field looked for from an earlier one's end (lib_service.lua add_tokens: the output text
    # scanned once), and found from the start when `from` is past it
    text = json_encoder.encode(tricky)
    got = json.loads(_eval(r, "local out, e = result_int(ARGV[1], 'output_tokens') "
                              "local pin, e2 = result_int(ARGV[1], 'batch_padded_len', e) "
                              "local back = result_int(ARGV[1], 'output_tokens', e2) "
                              "return cjson.encode({out, e, pin, e2, back})", text))
    out_at = text.decode().index(',"output_tokens":') + len(',"output_tokens":')
    pin_at = text.decode().index(',"batch_padded_len":') + len(',"batch_padded_len":')
    assert got == [tricky.output_tokens, out_at, tricky.batch_padded_len, pin_at, tricky.output_tokens]


def test_add_tokens_sums_what_result_int_reads(redis_url):
    """lib_service.lua add_tokens writes result_int out for its two fields: the same sums, for a field
    name inside the output text, a field missing, and the two fields in the other order."""
    r = redis.Redis.from_url(redis_url)
    tricky = msgspec.structs.replace(RESULTS[0], output=',"output_tokens":999,"batch_padded_len":5')
    recs = [json_encoder.encode(RESULTS[0]), json_encoder.encode(tricky), b'{"id":"x","output_tokens":4}',
            b'{"id":"x","batch_padded_len":7,"output_tokens":3}']
    got = _eval(r, "--@include lib_service.lua\n"
                   "local g, ats, pin, pout = {}, {}, 0, 0 "
                   "for i = 1, #ARGV do ats[i] = i - 3 end "  # add_tokens reads argv[o + 3]
                   "add_tokens(g, ARGV, ats, #ARGV) "
                   "for i = 1, #ARGV do "
                   "  local out, e = result_int(ARGV[i], 'output_tokens') "
                   "  pout = pout + (out or 0) "
                   "  pin = pin + (result_int(ARGV[i], 'batch_padded_len', e) or 0) "
                   "end "
                   "return {g.pin, g.pout, pin, pout}", *recs)
    pin = RESULTS[0].batch_padded_len + tricky.batch_padded_len + 7
    out = RESULTS[0].output_tokens + tricky.output_tokens + 4 + 3
    assert got == [pin, out, pin, out]


def test_a_rule_changed_in_python_changes_the_loaded_lua(redis_url, monkeypatch):
    r = redis.Redis.from_url(redis_url)
    monkeypatch.setitem(rules.LUA_RULES, "MAX_ID_BYTES", 77)
    assert _eval(r, "return RULES.MAX_ID_BYTES") == 77
    monkeypatch.setattr(rules, "NAME_CHARS", "a-z")
    assert _eval(r, "return name_ok(ARGV[1]) and 1 or 0", "A") == 0
