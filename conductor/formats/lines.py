"""Input lines: validation at the edge, with the line number and field name of every refusal.

Two formats are accepted, detected per line: native (conductor/formats/native.py) and OpenAI's
batch input (conductor/formats/openai_input.py, its request options openai_options.py); the
checks of their fields are conductor/formats/checks.py, the item they build
conductor/formats/items.py.
"""

from __future__ import annotations

import msgspec

from conductor.errors import BadInput
from conductor.formats.checks import MAX_LINE_BYTES, kind
from conductor.formats.items import Facts
from conductor.formats.native import from_native, native_facts, native_fast
from conductor.formats.openai_input import (
    CHAT_URL,
    MaxTokensDefault,
    chat_facts,
    from_openai,
    openai_fast,
    request_url,
)
from conductor.redis_contract.records import PreparedItem

_json = msgspec.json.Encoder()


def facts_of(it: PreparedItem) -> Facts:
    """The facts of an item already built (its payload read as from_openai writes it)."""
    if it.body.endswith(b',{"custom_id":' + _json.encode(it.id) + b"}]"):
        return Facts(it.id, it.model, it.input_tokens, CHAT_URL)  # a chat request without options
    payload = msgspec.json.decode(it.body)[1]
    return Facts(it.id, it.model, it.input_tokens, request_url(payload, it.id))


_BOM = b"\xef\xbb\xbf"


def line_facts(raw: bytes, line: int | None = None, default_max_tokens: MaxTokensDefault | None = None) -> Facts:
    """What ``parse_line`` checks of a line, without building its item for the common forms (a
    third of the time: a file's check pass runs before its first write, while Redis idles; the send
    pass builds the items while Redis runs the chunk before). A line accepted here is one
    ``parse_line`` accepts with these facts; any other goes through ``parse_line``, which refuses it
    naming the field, or builds it."""
    if len(raw) <= MAX_LINE_BYTES and not raw.startswith(_BOM):
        light = native_facts(raw) if b'"custom_id"' not in raw else chat_facts(raw, default_max_tokens)
        if light is not None:
            return light
    return facts_of(parse_line(raw, line, default_max_tokens))


def parse_line(raw: bytes | str, line: int | None = None,
               default_max_tokens: MaxTokensDefault | None = None) -> PreparedItem:
    """One input line as an item. ``default_max_tokens(model)`` gives the output cap of an OpenAI line
    without one (the model's ``default_max_tokens`` setting; DEFAULT_MAX_TOKENS when None)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if raw.startswith(_BOM) and line in (None, 1):
        raw = raw[len(_BOM):]  # a file saved "with BOM" (Windows editors, Excel's UTF-8 CSV export)
    if len(raw) > MAX_LINE_BYTES:
        raise BadInput("line", f"longer than {MAX_LINE_BYTES} bytes", line)
    # a valid line of the common forms in one C call (msgspec checks its UTF-8 too)
    fast = native_fast(raw) if b'"custom_id"' not in raw else openai_fast(raw, default_max_tokens)
    if fast is not None:
        return fast
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput("line", f"invalid UTF-8 at byte {e.start}", line) from None
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadInput("line", f"not valid JSON ({e})", line) from None
    if not isinstance(obj, dict):
        raise BadInput("line", f"must be a JSON object, got {kind(obj)}", line)
    if "custom_id" in obj:
        return from_openai(obj, line, default_max_tokens)
    if "id" in obj:
        return from_native(obj, line)
    raise BadInput("format", "unknown format: expected a native item (with \"id\") or an OpenAI batch "
                   "line (with \"custom_id\")", line)
