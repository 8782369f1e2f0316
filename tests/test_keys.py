"""Every key suffix a Lua script builds is one conductor/redis_contract/keys.py's layout table lists.

The scripts derive per-shape, per-lane and per-job key names from KEYS[1] (``base``) with string
concatenation, out of sight of the Python key helpers: a suffix typed differently in a script
would read or write a key nothing else knows about.
"""

from __future__ import annotations

import re
from pathlib import Path

import conductor.redis_contract.keys
from tests.conftest import ROOT

# base .. ':name' / base .. ':name:' (model keys), ik .. ':name' (shape instance keys),
# jk .. ':name' (job keys), ji .. ':name' (the producer's job keys); ik, jk and ji are the scripts' names for
# M:inst:S:E, M:job:J and M:in:J.
_BUILT = re.compile(r"\b(base|ik|jk|ji)\s*\.\.\s*'(:[a-z_]+:?)'")
# A pub/sub channel, not a key: the layout table lists keys only.
_CHANNEL = re.compile(r"'PUBLISH'\s*,\s*base\s*\.\.\s*'(:[a-z_]+)'")
_ROW = re.compile(r"^\s{4}(cdr:\S+|M:\S+)\s+\w+\s", re.M)
_PREFIX = {"base": "M", "ik": "M:inst:S:E", "jk": "M:job:J", "ji": "M:in:J"}


def layout_keys() -> set[str]:
    doc = conductor.redis_contract.keys.__doc__ or ""
    return set(_ROW.findall(doc))


def missing_suffixes(lua: str, layout: set[str]) -> tuple[set[str], set[str]]:
    """(every key built in ``lua``, as a layout pattern; those the layout does not list)."""
    channels = set(_CHANNEL.findall(lua))
    built = set()
    for var, suffix in _BUILT.findall(lua):
        if var == "base" and suffix in channels:
            continue
        built.add(_PREFIX[var] + suffix.rstrip(":"))
    # M:lane matches the row M:lane:S:E:L: a row lists the key itself or keys below it.
    missing = {b for b in built if not any(k == b or k.startswith(b + ":") for k in layout)}
    return built, missing


def lua_files() -> list[Path]:
    return sorted((ROOT / "lua").glob("*.lua"))


def test_the_layout_table_is_read():
    layout = layout_keys()
    assert len(layout) >= 25
    assert {"M:lane:S:E:L", "M:lanetok:S:E:L", "M:inst:S:E:ready", "M:job:J:items"} <= layout


def test_every_suffix_the_scripts_build_is_in_the_layout():
    layout = layout_keys()
    files = lua_files()
    assert any(p.name == "claim.lua" for p in files)
    everything, missing = set(), {}
    for p in files:
        built, miss = missing_suffixes(p.read_text(encoding="utf-8"), layout)
        everything |= built
        for m in miss:
            missing.setdefault(m, []).append(p.name)
    # The scan must actually see the scripts' keys for the check to mean anything.
    assert len(everything) >= 15, sorted(everything)
    assert {"M:lane", "M:lanetok", "M:lanemeta", "M:inst:S:E:ready", "M:job:J:items"} <= everything
    assert not missing, f"key names built in lua/ but missing from conductor/redis_contract/keys.py's layout: {missing}"


def test_the_check_catches_an_unlisted_suffix():
    lua = ("redis.call('DEL', base .. ':lanez:' .. inst)\n"
           "redis.call('ZADD', ik .. ':fill', 1, lane)\n"
           "redis.call('PUBLISH', base .. ':events', 'x')\n")
    built, missing = missing_suffixes(lua, layout_keys())
    assert built == {"M:lanez", "M:inst:S:E:fill"}
    assert missing == {"M:lanez"}


def test_claim_reads_every_config_field_it_uses():
    # claim.lua loads only CLAIM_CFG (a read per field costs); a field used but not loaded would
    # be nil at run time, on whichever path uses it. The script as loaded: its includes inlined.
    from conductor.redis_contract.scripts import source
    claim = source("claim")
    loaded = set(re.findall(r"'(\w+)'", re.search(r"local CLAIM_CFG = \{(.*?)\}", claim, re.S).group(1)))
    used = set(re.findall(r"\bcfg\.(\w+)", claim))
    assert len(used) >= 10
    assert used <= loaded, f"claim.lua uses cfg fields it does not load: {sorted(used - loaded)}"


# redis.call('HSET' | 'HINCRBY' | 'HDEL' | ..., <the state key>, ...): the scripts name M:state
# state_key (claim.lua's includes c.state_key).
_STATE_WRITE = re.compile(r"redis\.call\(\s*'(HSET|HSETNX|HINCRBY|HINCRBYFLOAT|HDEL)'\s*,\s*(?:c\.)?state_key\s*,")


def _call_args(text: str, i: int) -> list[str]:
    """The comma-separated arguments from text[i] up to the call's closing parenthesis."""
    depth, cur, out, quote = 0, "", [], None
    while i < len(text):
        ch = text[i]
        cur += ch
        if quote:
            if ch == "\\":
                cur += text[i + 1]
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "({":
            depth += 1
        elif ch in ")}":
            if depth == 0:
                out.append(cur[:-1].strip())
                return out
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur[:-1].strip())
            cur = ""
        i += 1
    raise AssertionError(f"unclosed call at {text[i - 40:i]!r}")


def state_fields_written(lua: str) -> list[str]:
    """Every field argument of a write to M:state in ``lua``, as written (a literal is quoted)."""
    out = []
    for m in _STATE_WRITE.finditer(lua):
        args = _call_args(lua, m.end())
        cmd = m.group(1)
        positions = range(0, len(args), 2) if cmd == "HSET" else range(len(args)) if cmd == "HDEL" else [0]
        out += [args[p] for p in positions]
    return out


def test_every_state_field_the_scripts_write_is_listed_in_keys():
    written: dict[str, set[str]] = {}
    for p in lua_files():
        for f in state_fields_written(p.read_text(encoding="utf-8")):
            assert re.fullmatch(r"'\w+'", f), f"{p.name} writes M:state field {f}, not a literal: list it by name"
            written.setdefault(f.strip("'"), set()).add(p.name)
    assert len(written) >= 25, sorted(written)  # the scan sees the scripts' writes
    missing = {f: sorted(w) for f, w in written.items() if f not in conductor.redis_contract.keys.STATE_FIELDS}
    assert not missing, \
        f"M:state fields written in lua/ but missing from conductor/redis_contract/keys.py STATE_FIELDS: {missing}"
    # and the list holds nothing that nobody writes (paused: Conductor.pause writes it)
    assert set(conductor.redis_contract.keys.STATE_FIELDS) - set(written) == {"paused"}


def test_the_state_scan_reads_multi_field_writes():
    lua = ("redis.call('HSET', state_key, 'a', num(st.x) + 1, 'b', f(1, 2))\n"
           "redis.call('HINCRBY', c.state_key, 'c', -plan.n)\nredis.call('HDEL', state_key, 'd', 'e')\n"
           "redis.call('HSET', other_key, 'zz', 1)\nredis.call('HSET', state_key, name, 1)\n")
    assert state_fields_written(lua) == ["'a'", "'b'", "'c'", "'d'", "'e'", "name"]
