"""The checks of an input line's fields, shared by its formats (conductor/formats/native.py,
openai_input.py): the bounds of a line, an id, a prefix, a payload and token counts, a model's
name, and each check's refusal, naming the field and the line (``BadInput``)."""

from __future__ import annotations

from typing import Any

from conductor.errors import BadInput
from conductor.redis_contract.keys import check_name
from conductor.redis_contract.rules import MAX_ID_BYTES as MAX_ID_BYTES  # the edge's limits are rules.py's
from conductor.redis_contract.rules import MAX_INPUT_TOKENS as MAX_INPUT_TOKENS
from conductor.redis_contract.rules import MAX_OUTPUT_TOKENS as MAX_OUTPUT_TOKENS
from conductor.redis_contract.rules import MAX_PREFIX_PARTS as MAX_PREFIX_PARTS

MAX_LINE_BYTES = 4 * 1024 * 1024
MAX_PAYLOAD_BYTES = 1024 * 1024
_JSON_KINDS = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
               dict: "an object", type(None): "null"}


def kind(v: Any) -> str:
    """A value's JSON kind, as the line's author wrote it ("a string", "null"), not Python's type."""
    return _JSON_KINDS.get(type(v), type(v).__name__)


def _missing(obj: dict[str, Any], field: str, name: str, line: int | None) -> None:
    if field not in obj:
        raise BadInput(name, "missing", line)


def int_field(obj: dict[str, Any], field: str, lo: int, hi: int, line: int | None, name: str | None = None) -> int:
    v = obj.get(field)
    name = name or field
    _missing(obj, field, name, line)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(name, f"must be an integer, got {kind(v)}", line)
    if v < lo or v > hi:
        raise BadInput(name, f"must be between {lo} and {hi}, got {v}", line)
    return v


def str_field(obj: dict[str, Any], field: str, line: int | None, name: str | None = None,
              allow_empty: bool = True) -> str:
    v = obj.get(field)
    name = name or field
    _missing(obj, field, name, line)
    if not isinstance(v, str):
        raise BadInput(name, f"must be a string, got {kind(v)}", line)
    if not allow_empty and not v:
        raise BadInput(name, "must not be empty", line)
    return v


def check_id(v: str, line: int | None, name: str = "id") -> str:
    if not v:
        raise BadInput(name, "must not be empty", line)
    if len(v.encode("utf-8")) > MAX_ID_BYTES:
        raise BadInput(name, f"longer than {MAX_ID_BYTES} bytes", line)
    return v


def check_model(v: str, line: int | None, name: str = "model") -> str:
    try:
        return check_name("model", v)
    except ValueError as e:
        raise BadInput(name, str(e).split(": ", 1)[1], line) from None


_GOOD_NAMES: set[str] = set()  # model names seen valid (a file names a few): checked once each


def name_ok(v: str) -> bool:
    if v in _GOOD_NAMES:
        return True
    try:
        check_name("model", v)
    except ValueError:
        return False
    if len(_GOOD_NAMES) < 1024:
        _GOOD_NAMES.add(v)
    return True
