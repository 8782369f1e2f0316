"""Every key suffix a Lua script builds is one conductor/keys.py's layout table lists.

The scripts derive per-shape, per-lane and per-job key names from KEYS[1] (``base``) with string
concatenation, out of sight of the Python key helpers: a suffix typed differently in a script
would read or write a key nothing else knows about.
"""

from __future__ import annotations

import re
from pathlib import Path

import conductor.keys
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
    doc = conductor.keys.__doc__ or ""
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
    assert not missing, f"key names built in lua/ but missing from conductor/keys.py's layout: {missing}"


def test_the_check_catches_an_unlisted_suffix():
    lua = ("redis.call('DEL', base .. ':lanez:' .. inst)\n"
           "redis.call('ZADD', ik .. ':fill', 1, lane)\n"
           "redis.call('PUBLISH', base .. ':events', 'x')\n")
    built, missing = missing_suffixes(lua, layout_keys())
    assert built == {"M:lanez", "M:inst:S:E:fill"}
    assert missing == {"M:lanez"}


def test_claim_reads_every_config_field_it_uses():
    # claim.lua loads only CLAIM_CFG (a read per field costs); a field used but not loaded would
    # be nil at run time, on whichever path uses it
    import re
    from pathlib import Path
    lua = Path(__file__).resolve().parent.parent / "lua"
    claim = (lua / "claim.lua").read_text()
    loaded = set(re.findall(r"'(\w+)'", re.search(r"local CLAIM_CFG = \{(.*?)\}", claim, re.S).group(1)))
    lib = (lua / "lib.lua").read_text()
    used = set(re.findall(r"\bcfg\.(\w+)", claim)) | set(re.findall(r"\bcfg\.(\w+)", lib))
    assert len(used) >= 10
    assert used <= loaded, f"claim.lua uses cfg fields it does not load: {sorted(used - loaded)}"
