"""OpenAI's batch input line: ``{"custom_id", "method", "url", "body": {"model", "messages",
"max_tokens" | "max_completion_tokens" (optional: the model's ``default_max_tokens``)}}``.

Every message but the last is a cacheable prefix component (``"role: content"``), the last
message's content is the prompt; a content is a string or a list of text parts. ``url`` is one of
the endpoints served: ``/v1/chat/completions`` (messages) or ``/v1/completions`` (``body.prompt``,
no prefix). The payload of such an item is ``{"custom_id"}`` (plus ``"url"`` for a completion, and
``"options"``, the request options: conductor/formats/openai_options.py), which the OpenAI output
format (conductor/formats/openai_output.py) reads back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import msgspec

from conductor.errors import BadInput
from conductor.formats.checks import (
    MAX_ID_BYTES,
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_PREFIX_PARTS,
    check_id,
    check_model,
    int_field,
    kind,
    name_ok,
    str_field,
)
from conductor.formats.items import Facts, prepare, tokens_of_bytes
from conductor.formats.openai_options import request_options_of
from conductor.redis_contract.records import PreparedItem
from conductor.redis_contract.rules import DEFAULT_MAX_TOKENS  # for a parse without a Redis to ask

# The endpoints served: a line naming another is refused (an embeddings line is not a completion).
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
_OPENAI_FIELDS = {"custom_id", "method", "url", "body"}
MaxTokensDefault = Callable[[str], int]


def _content(v: Any, line: int | None, name: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise BadInput(name, f"must be a string or a non-empty list of text parts, got {kind(v)}", line)
    texts = []
    for i, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise BadInput(f"{name}[{i}]", "must be a text part {\"type\": \"text\", \"text\": ...} "
                           "(images, audio and files are not served)", line)
        texts.append(str_field(part, "text", line, f"{name}[{i}].text"))
    return "\n".join(texts)


def _max_tokens(body: dict[str, Any], model: str, line: int | None, default: MaxTokensDefault | None) -> int:
    given = [f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None]
    if not given:
        return default(model) if default else DEFAULT_MAX_TOKENS
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise BadInput("body.max_tokens", "differs from body.max_completion_tokens: give one", line)
    return int_field(body, given[0], 1, MAX_OUTPUT_TOKENS, line, f"body.{given[0]}")


def from_openai(obj: dict[str, Any], line: int | None = None,
                default_max_tokens: MaxTokensDefault | None = None) -> PreparedItem:
    unknown = set(obj) - _OPENAI_FIELDS
    if unknown:
        raise BadInput(sorted(unknown)[0], "unknown field (OpenAI batch line fields: "
                       + ", ".join(sorted(_OPENAI_FIELDS)) + ")", line)
    id_ = check_id(str_field(obj, "custom_id", line), line, "custom_id")
    if obj.get("method", "POST") != "POST":
        raise BadInput("method", f"must be POST, got {obj.get('method')!r}", line)
    url = obj.get("url", CHAT_URL)
    if url not in ENDPOINTS:
        raise BadInput("url", f"{url!r} is not served (served: {', '.join(ENDPOINTS)})", line)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadInput("body", "must be an object", line)
    model = check_model(str_field(body, "model", line, "body.model"), line, "body.model")
    options = request_options_of(body, line)
    prefix, prompt = _completion_prompt(body, line) if url == COMPLETIONS_URL else _chat_prompt(body, line)
    max_tokens = _max_tokens(body, model, line, default_max_tokens)
    # The payload travels with the item to its result: what the OpenAI output format needs, and
    # the request options for the engine (stored with the item, so a rerun samples the same way).
    payload: dict[str, Any] = {"custom_id": id_}
    if url == COMPLETIONS_URL:
        payload["url"] = url
    if options:
        payload["options"] = options
    return prepare(id_, model, prefix, prompt, None, max_tokens, payload, line)


def request_url(payload: Any, id_: str) -> str | None:
    if not isinstance(payload, dict) or payload.get("custom_id") != id_:
        return None
    return str(payload.get("url", CHAT_URL))


def _completion_prompt(body: dict[str, Any], line: int | None) -> tuple[list[str], str]:
    """/v1/completions: body.prompt, a string (or a one-string list); no prefix."""
    if "messages" in body:
        raise BadInput("body.messages", f"{COMPLETIONS_URL} takes body.prompt, not messages", line)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # OpenAI accepts a one-string list
    if not isinstance(prompt, str):
        raise BadInput("body.prompt", f"must be a string, got {kind(prompt)}", line)
    return [], prompt


def _chat_prompt(body: dict[str, Any], line: int | None) -> tuple[list[str], str]:
    """/v1/chat/completions: every message but the last is a prefix component, the last the prompt."""
    if "prompt" in body:
        raise BadInput("body.prompt", f"{CHAT_URL} takes body.messages, not prompt", line)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadInput("body.messages", "must be a non-empty list", line)
    if len(msgs) > MAX_PREFIX_PARTS + 1:
        raise BadInput("body.messages", f"more than {MAX_PREFIX_PARTS + 1} messages", line)
    parts = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadInput(f"body.messages[{i}]", "must be an object", line)
        role = str_field(m, "role", line, f"body.messages[{i}].role")
        parts.append((role, _content(m.get("content"), line, f"body.messages[{i}].content")))
    return [f"{r}: {c}" for r, c in parts[:-1]], parts[-1][1]


class _Message(msgspec.Struct):
    role: str
    content: str  # a list of text parts goes the field-by-field way


class _ChatBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    messages: list[_Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class _ChatLine(msgspec.Struct, forbid_unknown_fields=True):
    """An OpenAI chat request line of the plainest form (no options, string contents): the fast
    path of ``parse_line``, like ``_Native``; any other line goes the field-by-field way."""

    custom_id: str
    body: _ChatBody
    method: str = "POST"
    url: str = CHAT_URL


_chat_line = msgspec.json.Decoder(_ChatLine)


def _chat_checked(raw: bytes, default_max_tokens: MaxTokensDefault | None) -> tuple[_ChatLine, str, int] | None:
    """A plain chat request line msgspec decodes, within every bound ``from_openai`` checks, with
    its model and output cap (the model's default asked when the line has none); None otherwise."""
    try:
        line = _chat_line.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    b, id_ = line.body, line.custom_id
    msgs = b.messages
    if not (id_ and len(id_) <= MAX_ID_BYTES // 4 and line.method == "POST" and line.url == CHAT_URL
            and 1 <= len(msgs) <= MAX_PREFIX_PARTS + 1 and name_ok(b.model)):
        return None
    given = [v for v in (b.max_completion_tokens, b.max_tokens) if v is not None]
    if len(given) == 2 and given[0] != given[1]:
        return None
    if given and not 1 <= given[0] <= MAX_OUTPUT_TOKENS:
        return None
    model = sys.intern(b.model)
    max_tokens = given[0] if given else default_max_tokens(model) if default_max_tokens else DEFAULT_MAX_TOKENS
    return line, model, max_tokens


def openai_fast(raw: bytes, default_max_tokens: MaxTokensDefault | None) -> PreparedItem | None:
    """The item of a plain chat request line, the same as ``from_openai`` makes; None for any line
    ``from_openai`` might refuse or read otherwise."""
    checked = _chat_checked(raw, default_max_tokens)
    if checked is None:
        return None
    line, model, max_tokens = checked
    msgs, id_ = line.body.messages, line.custom_id
    prefix = [f"{m.role}: {m.content}" for m in msgs[:-1]]
    try:
        return prepare(id_, model, prefix, msgs[-1].content, None, max_tokens, {"custom_id": id_}, None)
    except BadInput:
        return None


def chat_facts(raw: bytes, default_max_tokens: MaxTokensDefault | None) -> Facts | None:
    """``openai_fast`` without building the item (its token estimate counts the same bytes)."""
    checked = _chat_checked(raw, default_max_tokens)
    if checked is None:
        return None
    line, model, _ = checked
    msgs = line.body.messages
    size = sum(len(m.role.encode("utf-8")) + 2 + len(m.content.encode("utf-8")) for m in msgs[:-1])
    size += len(msgs[-1].content.encode("utf-8"))
    return Facts(line.custom_id, model, min(tokens_of_bytes(size), MAX_INPUT_TOKENS), CHAT_URL)
