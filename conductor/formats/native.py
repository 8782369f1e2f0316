"""The native input line: ``{"id", "model", "prefix": [cacheable parts, in order], "prompt",
"input_tokens" (optional), "max_tokens", "payload" (optional, any JSON)}``.

A valid line is decoded and type-checked in one C call (msgspec, ``native_fast``); any other goes
the field-by-field way (``from_native``), which names the field it refuses.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from conductor.errors import BadInput
from conductor.formats.checks import (
    MAX_ID_BYTES,
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_PAYLOAD_BYTES,
    MAX_PREFIX_PARTS,
    check_id,
    check_model,
    int_field,
    kind,
    name_ok,
    str_field,
)
from conductor.formats.items import Facts, estimate_tokens, prepare
from conductor.formats.openai_input import request_url
from conductor.redis_contract.records import PreparedItem

_json = msgspec.json.Encoder()


NATIVE_FIELDS = {"id", "model", "prefix", "prompt", "input_tokens", "max_tokens", "payload"}


class _Native(msgspec.Struct, forbid_unknown_fields=True):
    """A native line as msgspec decodes and type-checks it in one C call (the fast path of
    ``parse_line``); a line it refuses goes the field-by-field way, which names the field."""

    id: str
    model: str
    prompt: str
    max_tokens: int
    prefix: list[str] = []
    input_tokens: int | None = None
    payload: Any = None


_native = msgspec.json.Decoder(_Native)


def _native_checked(raw: bytes) -> _Native | None:
    """A native line msgspec decodes, within every bound ``from_native`` checks (the payload's size
    aside: ``prepare`` measures it); None for any other line."""
    try:
        n = _native.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    tok = n.input_tokens
    if not (n.id and len(n.id) <= MAX_ID_BYTES // 4 and 1 <= n.max_tokens <= MAX_OUTPUT_TOKENS
            and (tok is None or 1 <= tok <= MAX_INPUT_TOKENS) and len(n.prefix) <= MAX_PREFIX_PARTS
            and name_ok(n.model)):
        return None
    return n


def native_fast(raw: bytes) -> PreparedItem | None:
    """The item of a valid native line, the same as ``from_native`` makes; None for any line
    ``from_native`` might refuse (it then says why)."""
    n = _native_checked(raw)
    if n is None:
        return None
    try:  # one copy of a model's name for the items of a file (the check keeps many of them)
        return prepare(n.id, sys.intern(n.model), n.prefix, n.prompt, n.input_tokens, n.max_tokens, n.payload, None)
    except BadInput:
        return None


def from_native(obj: dict[str, Any], line: int | None = None) -> PreparedItem:
    unknown = set(obj) - NATIVE_FIELDS
    if unknown:
        raise BadInput(sorted(unknown)[0], "unknown field (native format fields: "
                       + ", ".join(sorted(NATIVE_FIELDS)) + ")", line)
    id_ = check_id(str_field(obj, "id", line), line)
    model = check_model(str_field(obj, "model", line), line)
    prefix = obj.get("prefix", [])
    if not isinstance(prefix, list):
        raise BadInput("prefix", f"must be a list of strings, got {kind(prefix)}", line)
    if len(prefix) > MAX_PREFIX_PARTS:
        raise BadInput("prefix", f"more than {MAX_PREFIX_PARTS} components", line)
    for i, p in enumerate(prefix):
        if not isinstance(p, str):
            raise BadInput(f"prefix[{i}]", f"must be a string, got {kind(p)}", line)
    prompt = str_field(obj, "prompt", line)
    tokens = None
    if obj.get("input_tokens") is not None:
        tokens = int_field(obj, "input_tokens", 1, MAX_INPUT_TOKENS, line)
    max_tokens = int_field(obj, "max_tokens", 1, MAX_OUTPUT_TOKENS, line)
    return prepare(id_, model, prefix, prompt, tokens, max_tokens, obj.get("payload"), line)


def native_facts(raw: bytes) -> Facts | None:
    """``native_fast`` without building the item: the same decode and the same bounds, and the
    payload's size measured as ``prepare`` measures it; None where ``native_fast`` gives None."""
    n = _native_checked(raw)
    if n is None:
        return None
    if n.payload is not None and len(_json.encode(n.payload)) - 4 > MAX_PAYLOAD_BYTES:
        return None  # prepare refuses it, naming the payload
    tok = n.input_tokens
    if tok is None:
        tok = min(estimate_tokens(n.prefix, n.prompt), MAX_INPUT_TOKENS)
    return Facts(n.id, sys.intern(n.model), tok, request_url(n.payload, n.id))
