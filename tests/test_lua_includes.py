"""conductor/redis_contract/scripts.py's include mechanism: includes nest, each file is inlined once, a cycle is
an error; lib_generated.lua carries config.py's names and defaults and keys.py's group name into
the Lua as loaded, so the two cannot drift (issue 14)."""

from __future__ import annotations

import json
import re

import pytest
import redis

from conductor.redis_contract import config, keys, scripts
from conductor.redis_contract.scripts import NAMES, expand, source
from tests.conftest import ROOT


def reader(files: dict[str, str]):
    return lambda name: files[name]


def test_includes_nest_and_each_file_is_inlined_once():
    files = {"a.lua": "A1\n--@include b.lua\n--@include c.lua\nA2\n",
             "b.lua": "B1\n--@include c.lua\nB2\n",
             "c.lua": "C\n"}
    out = expand("a.lua", reader(files))
    assert out.split("\n") == ["A1", "B1", "C", "B2", "", "A2", ""]  # c where b first named it, then not again


def test_an_include_cycle_is_an_error():
    files = {"a.lua": "--@include b.lua\n", "b.lua": "--@include c.lua\n", "c.lua": "--@include a.lua\n"}
    with pytest.raises(ValueError, match=r"cycle: a.lua -> b.lua -> c.lua -> a.lua"):
        expand("a.lua", reader(files))
    with pytest.raises(ValueError, match="cycle: s.lua -> s.lua"):
        expand("s.lua", reader({"s.lua": "x\n--@include s.lua\n"}))


def test_every_script_inlines_each_of_its_includes_once():
    libs = sorted(p.name for p in (ROOT / "lua").glob("lib*.lua"))
    for name in NAMES:
        text = source(name)
        assert not re.search(r"^--@include", text, re.M), name
        for lib in [*libs, "lib_generated.lua"]:
            # every include's header names its file on its first line
            assert text.count(f"-- {lib}:") <= 1, (name, lib)
        assert text.count("-- lib_generated.lua:") == 1, name
    claim = source("claim")
    for lib in ("lib.lua", "lib_cleanup.lua", "lib_gate.lua", "lib_lifecycle.lua", "lib_lanes.lua", "lib_deliver.lua",
                "lib_serve.lua", "lib_claim_guard.lua"):
        assert claim.count(f"-- {lib}:") == 1, lib


def _eval_lib(r: redis.Redis, body: str, *keys_: str) -> object:
    text = expand("t.lua", lambda f: "--@include lib.lua\n" + body if f == "t.lua" else scripts._read(f))
    return r.eval(text, len(keys_), *keys_)


def test_the_lua_config_names_defaults_and_group_are_config_py_and_keys_py(redis_url):
    r = redis.Redis.from_url(redis_url)
    got = json.loads(_eval_lib(r, "return cjson.encode({CFG_NAMES, CFG_DEFAULTS, GROUP})"))
    assert got[0] == list(config.FIELDS)
    assert got[1] == config.DEFAULTS
    assert got[2] == keys.GROUP


def test_changing_a_default_or_the_group_in_python_changes_the_loaded_lua(redis_url, monkeypatch):
    r = redis.Redis.from_url(redis_url)
    r.delete("cdr:{t}:cfg")
    assert _eval_lib(r, "return load_cfg(KEYS[1]).quiet_ms", "cdr:{t}:cfg") == config.DEFAULTS["quiet_ms"]
    monkeypatch.setitem(config.DEFAULTS, "quiet_ms", 4321)
    monkeypatch.setattr(keys, "GROUP", "other")
    assert _eval_lib(r, "return load_cfg(KEYS[1]).quiet_ms", "cdr:{t}:cfg") == 4321
    assert _eval_lib(r, "return GROUP") == b"other"
    assert "quiet_ms = 4321" in scripts.generated()


def test_generated_refuses_a_default_lua_cannot_hold(monkeypatch):
    monkeypatch.setitem(config.DEFAULTS, "quiet_ms", [1])
    with pytest.raises(TypeError, match="Lua form"):
        scripts.generated()


def test_no_script_is_over_200_lines_includes_apart():
    long = {name: n for name in NAMES if (n := len((ROOT / "lua" / f"{name}.lua").read_text().splitlines())) > 200}
    assert not long, long


def test_every_include_has_a_header_naming_it_its_keys_and_invariant():
    for p in sorted((ROOT / "lua").glob("lib_*.lua")):
        text = p.read_text()
        assert text.startswith(f"-- {p.name}: "), p.name
        head = text.split("\nlocal ", 1)[0]
        assert "Keys:" in head and "Invariant" in head, p.name


def test_the_acl_harness_sees_the_commands_of_nested_includes():
    # tests/script_harness.py script_commands: what each script may call, through its includes
    # (nested ones too), is what the atomicity harness requires a scenario to reach
    from tests.script_harness import script_commands
    # lib_deliver, lib_serve, lib_lifecycle
    assert {"xclaim", "sort", "xadd", "ltrim", "zrangebyscore", "hgetall"} <= script_commands("claim")
    assert {"time", "hmget", "xack", "rpush"} <= script_commands("fail")  # lib_requeue_prologue -> lib_requeue
    assert {"lpush", "ltrim", "spop"} <= script_commands("submit")  # lib_intake
    assert "xclaim" not in script_commands("submit")


def _code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("--"))


def test_no_line_of_lua_is_over_120_characters():
    long = [f"{p.name}:{i}" for p in sorted((ROOT / "lua").glob("*.lua"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, long


def test_each_library_fits_in_200_lines_and_each_script_in_about_100_lines_of_code():
    # issue 34: one concern a library, one state change a script; comments do not count for a script
    libs = {p.name: n for p in (ROOT / "lua").glob("lib*.lua") if (n := len(p.read_text().splitlines())) > 200}
    assert not libs, libs
    scripts_ = {name: n for name in NAMES if (n := _code_lines((ROOT / "lua" / f"{name}.lua").read_text())) > 100}
    assert not scripts_, scripts_
