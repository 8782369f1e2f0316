"""The text of lib_generated.lua, written from the Python homes of the rules Lua shares with Python.

Not a file of lua/: conductor/redis_contract/scripts.py inlines this text wherever lib.lua names
it, each time a script is loaded, so no Lua copy of these rules is kept by hand:
config.py's field names and defaults, keys.py's consumer group, rules.py's names, limits and
request-reply key rules, and the result record's layout, records.Result, as a builder.
"""

from __future__ import annotations

import msgspec

from conductor.redis_contract import config, keys, records, rules


def lua_value(v: object) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError(f"config default {v!r}: only numbers and strings have a Lua form here")
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(v)


def _encode(value: str, t: msgspec.inspect.Type, what: str) -> str:
    """The Lua expression that writes the JSON of ``value`` (a Lua expression) of type ``t``."""
    if isinstance(t, msgspec.inspect.StrType):
        return f"json_str({value} or '')"
    if isinstance(t, msgspec.inspect.IntType):
        return f"string.format('%d', {value} or 0)"
    if isinstance(t, msgspec.inspect.AnyType):  # JSON text kept as its producer sent it
        return f"({value} or 'null')"
    if (
        isinstance(t, msgspec.inspect.UnionType)
        and len(t.types) == 2
        and isinstance(t.types[1], msgspec.inspect.NoneType)
        and isinstance(t.types[0], msgspec.inspect.StructType)
    ):
        return f"({value} and {_object(value, t.types[0], what)} or 'null')"
    raise TypeError(f"{what}: a field of type {t!r} has no Lua form here")


def _object(value: str, t: msgspec.inspect.StructType, what: str) -> str:
    parts = []
    for i, f in enumerate(t.fields):
        key = ("{" if i == 0 else ",") + f'"{f.encode_name}":'
        parts.append(f"'{key}' .. {_encode(f'{value}.{f.name}', f.type, f'{what}.{f.name}')}")
    return "(" + " .. ".join(parts) + " .. '}')"


def result_builder() -> str:
    """result_record(r) and RESULT_INT, from records.Result's fields in their order: the record
    msgspec writes for a Result (compact JSON, every field), so the scripts' records and the
    workers' are one layout."""
    info = msgspec.inspect.type_info(records.Result)
    assert isinstance(info, msgspec.inspect.StructType)
    body = _object("r", info, "Result")[1:-1].split(" .. ")
    lines, line = [], "  return"
    for part in body:
        if len(line) + len(part) + 4 > 116:
            lines.append(line)
            line = "    .."
        line += " " + part if line.endswith(("return", "..")) else " .. " + part
    lines.append(line)
    ints = [f.encode_name for f in info.fields if isinstance(f.type, msgspec.inspect.IntType)]
    if info.fields[0].encode_name in ints:
        raise TypeError("Result: RESULT_INT's patterns need a field before the first whole number")
    anchors = ", ".join(f"{n} = ',\"{n}\":'" for n in ints)
    return (
        "-- The result record (records.Result): JSON of r's fields in Result's order, as msgspec writes it.\n"
        "-- Strings nil -> '', whole numbers nil -> 0, error nil -> null, payload: JSON text (nil -> null).\n"
        "local function result_record(r)\n" + "\n".join(lines) + "\n"
        "end\n"
        "-- Where a whole-number field of a result record starts, found without decoding it: a JSON\n"
        "-- string escapes its quotes, so the first plain match is the field itself, and a plain find\n"
        "-- (memchr, memcmp) costs a fraction of a pattern scanned over the output text (bench/RESULTS.md,\n"
        "-- redis_cost: 5.6 us a result of 700 bytes).\n"
        f"local RESULT_INT = {{{anchors}}}\n"
        "-- The whole number of field name in result record r, or nil; and where its key ends. A field that\n"
        "-- Result lists after another is looked for from `from`, that one's end, first: the output text\n"
        "-- between them is scanned once, not once per field.\n"
        "local function result_int(r, name, from)\n"
        "  local key = RESULT_INT[name]\n"
        "  local _, e = string.find(r, key, from or 1, true)\n"
        "  if not e and from then _, e = string.find(r, key, 1, true) end\n"
        "  local d = e and string.match(r, '^%d+', e + 1)\n"
        "  return d and d + 0, e  -- digits: one conversion (tonumber makes two)\n"
        "end\n"
    )


def generated() -> str:
    """The text of lib_generated.lua."""
    names = ", ".join(lua_value(n) for n in config.FIELDS)
    defaults = ", ".join(f"{n} = {lua_value(v)}" for n, v in config.DEFAULTS.items())
    shared = ",\n  ".join(f"{n} = {lua_value(v)}" for n, v in rules.LUA_RULES.items())
    name_pattern = lua_value(f"^[{rules.lua_class(rules.NAME_CHARS)}]+$")
    token_pattern = lua_value(f"^[{rules.lua_class(rules.TOKEN_CHARS)}]+$")
    end_codes = " or ".join(f"code == {lua_value(c)}" for c in rules.END_CODES)
    return (
        "-- lib_generated.lua: written by conductor/redis_contract/lua_generated.py when a script is\n"
        "-- loaded, never edited: CFG_NAMES and CFG_DEFAULTS from config.py FIELDS, GROUP from keys.py,\n"
        "-- RULES and name_ok from rules.py, result_record and RESULT_INT from records.py Result.\n"
        "-- lib.lua inlines it after json_str, which result_record calls.\n"
        f"local CFG_NAMES = {{{names}}}\n"
        f"local CFG_DEFAULTS = {{{defaults}}}\n"
        "-- The batches stream's consumer group, which holds the in-flight batches.\n"
        f"local GROUP = {lua_value(keys.GROUP)}\n"
        f"local RULES = {{\n  {shared}\n}}\n"
        "-- A model, job, tenant or worker name as keys.py check_name takes it.\n"
        "local function name_ok(v)\n"
        "  return type(v) == 'string' and #v >= 1 and #v <= RULES.NAME_MAX\n"
        f"    and string.match(v, {name_pattern}) ~= nil\n"
        "end\n"
        "-- A claim's batch token as rules.py TOKEN_RE takes it.\n"
        "local function token_ok(v)\n"
        "  return type(v) == 'string' and #v >= 1 and #v <= RULES.TOKEN_MAX\n"
        f"    and string.match(v, {token_pattern}) ~= nil\n"
        "end\n"
        "-- A lowercase hex string of exactly n digits (RULES.SIG_HEX, SUM_HEX, SEGMENT_NAME_HEX, FILE_SUM_HEX).\n"
        "local function hex_ok(v, n)\n"
        "  return type(v) == 'string' and #v == n and string.match(v, '^[0-9a-f]+$') ~= nil\n"
        "end\n"
        "-- The code of an early end's answers (rules.py END_CODES).\n"
        f"local function end_code_ok(code) return {end_codes} end\n"
        "-- A request job's name (conductor/client/request.py): its results also go to reply lists.\n"
        "local function is_request(job)\n"
        "  return string.sub(job, 1, #RULES.REQUEST_JOB_PREFIX) == RULES.REQUEST_JOB_PREFIX\n"
        "end\n" + result_builder()
    )
