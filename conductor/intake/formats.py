"""Input lines: validation at the edge, with the line number and field name of every refusal.

Two formats are accepted, detected per line:

* native: ``{"id", "model", "prefix": [cacheable parts, in order], "prompt", "input_tokens"
  (optional), "max_tokens", "payload" (optional, any JSON)}``
* OpenAI batch input: ``{"custom_id", "method", "url", "body": {"model", "messages",
  "max_tokens" | "max_completion_tokens" (optional: the model's ``default_max_tokens``)}}``; every
  message but the last is a cacheable prefix component (``"role: content"``), the last message's
  content is the prompt; a content is a string or a list of text parts. ``url`` is one of the
  endpoints served: ``/v1/chat/completions`` (messages) or ``/v1/completions`` (``body.prompt``, no
  prefix). The payload of such an item is ``{"custom_id"}`` (plus ``"url"`` for a completion), which
  the OpenAI output format (conductor/jobs/openai_output.py) reads back.

When ``input_tokens`` is absent it is estimated as ``ceil(utf8_bytes(prefix + prompt) / 4)``
(at least 1), a common rule of thumb for English BPE vocabularies; producers that know their
tokenizer should send the real count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec

from conductor.errors import BadInput
from conductor.intake.signature import shape_signature
from conductor.redis_contract.keys import check_name
from conductor.redis_contract.records import PreparedItem

MAX_LINE_BYTES = 4 * 1024 * 1024
MAX_PAYLOAD_BYTES = 1024 * 1024
MAX_ID_BYTES = 512
MAX_PREFIX_PARTS = 256
MAX_INPUT_TOKENS = 16_777_216
MAX_OUTPUT_TOKENS = 1_048_576

_NATIVE_FIELDS = {"id", "model", "prefix", "prompt", "input_tokens", "max_tokens", "payload"}


_json = msgspec.json.Encoder()


def estimate_tokens(prefix: list[str] | tuple[str, ...], prompt: str) -> int:
    n = sum(len(p.encode("utf-8")) for p in prefix) + len(prompt.encode("utf-8"))
    return max(1, math.ceil(n / 4))


def _int(obj: dict[str, Any], field: str, lo: int, hi: int, line: int | None, name: str | None = None) -> int:
    v = obj.get(field)
    name = name or field
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(name, f"must be an integer, got {type(v).__name__}", line)
    if v < lo or v > hi:
        raise BadInput(name, f"must be between {lo} and {hi}, got {v}", line)
    return v


def _str(obj: dict[str, Any], field: str, line: int | None, name: str | None = None, allow_empty: bool = True) -> str:
    v = obj.get(field)
    name = name or field
    if not isinstance(v, str):
        raise BadInput(name, f"must be a string, got {type(v).__name__}", line)
    if not allow_empty and not v:
        raise BadInput(name, "must not be empty", line)
    return v


def _check_id(v: str, line: int | None, name: str = "id") -> str:
    if not v:
        raise BadInput(name, "must not be empty", line)
    if len(v.encode("utf-8")) > MAX_ID_BYTES:
        raise BadInput(name, f"longer than {MAX_ID_BYTES} bytes", line)
    return v


def _check_model(v: str, line: int | None, name: str = "model") -> str:
    try:
        return check_name("model", v)
    except ValueError as e:
        raise BadInput(name, str(e).split(": ", 1)[1], line) from None


def _prepare(id_: str, model: str, prefix: list[str], prompt: str, input_tokens: int | None,
             max_tokens: int, payload: Any, line: int | None) -> PreparedItem:
    body = _json.encode([prompt, payload])
    if payload is not None and len(body) - len(_json.encode([prompt, None])) > MAX_PAYLOAD_BYTES:
        raise BadInput("payload", f"larger than {MAX_PAYLOAD_BYTES} bytes", line)
    if input_tokens is None:
        input_tokens = min(estimate_tokens(prefix, prompt), MAX_INPUT_TOKENS)
    return PreparedItem(id=id_, model=model, sig=shape_signature(prefix), input_tokens=input_tokens,
                        max_tokens=max_tokens, body=body, prefix=tuple(prefix))


def from_native(obj: dict[str, Any], line: int | None = None) -> PreparedItem:
    unknown = set(obj) - _NATIVE_FIELDS
    if unknown:
        raise BadInput(sorted(unknown)[0], "unknown field (native format fields: "
                       + ", ".join(sorted(_NATIVE_FIELDS)) + ")", line)
    id_ = _check_id(_str(obj, "id", line), line)
    model = _check_model(_str(obj, "model", line), line)
    prefix = obj.get("prefix", [])
    if not isinstance(prefix, list):
        raise BadInput("prefix", f"must be a list of strings, got {type(prefix).__name__}", line)
    if len(prefix) > MAX_PREFIX_PARTS:
        raise BadInput("prefix", f"more than {MAX_PREFIX_PARTS} components", line)
    for i, p in enumerate(prefix):
        if not isinstance(p, str):
            raise BadInput(f"prefix[{i}]", f"must be a string, got {type(p).__name__}", line)
    prompt = _str(obj, "prompt", line)
    tokens = None
    if obj.get("input_tokens") is not None:
        tokens = _int(obj, "input_tokens", 1, MAX_INPUT_TOKENS, line)
    max_tokens = _int(obj, "max_tokens", 1, MAX_OUTPUT_TOKENS, line)
    return _prepare(id_, model, prefix, prompt, tokens, max_tokens, obj.get("payload"), line)


# The endpoints served: a line naming another is refused (an embeddings line is not a completion).
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
_OPENAI_FIELDS = {"custom_id", "method", "url", "body"}
DEFAULT_MAX_TOKENS = 1024  # config.py's default_max_tokens, for a parse without a Redis to ask

MaxTokensDefault = Callable[[str], int]


def _content(v: Any, line: int | None, name: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise BadInput(name, f"must be a string or a non-empty list of text parts, got {type(v).__name__}", line)
    texts = []
    for i, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise BadInput(f"{name}[{i}]", "must be a text part {\"type\": \"text\", \"text\": ...} "
                           "(images, audio and files are not served)", line)
        texts.append(_str(part, "text", line, f"{name}[{i}].text"))
    return "\n".join(texts)


def _max_tokens(body: dict[str, Any], model: str, line: int | None, default: MaxTokensDefault | None) -> int:
    given = [f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None]
    if not given:
        return default(model) if default else DEFAULT_MAX_TOKENS
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise BadInput("body.max_tokens", "differs from body.max_completion_tokens: give one", line)
    return _int(body, given[0], 1, MAX_OUTPUT_TOKENS, line, f"body.{given[0]}")


def from_openai(obj: dict[str, Any], line: int | None = None,
                default_max_tokens: MaxTokensDefault | None = None) -> PreparedItem:
    unknown = set(obj) - _OPENAI_FIELDS
    if unknown:
        raise BadInput(sorted(unknown)[0], "unknown field (OpenAI batch line fields: "
                       + ", ".join(sorted(_OPENAI_FIELDS)) + ")", line)
    id_ = _check_id(_str(obj, "custom_id", line), line, "custom_id")
    if obj.get("method", "POST") != "POST":
        raise BadInput("method", f"must be POST, got {obj.get('method')!r}", line)
    url = obj.get("url", CHAT_URL)
    if url not in ENDPOINTS:
        raise BadInput("url", f"{url!r} is not served (served: {', '.join(ENDPOINTS)})", line)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadInput("body", "must be an object", line)
    model = _check_model(_str(body, "model", line, "body.model"), line, "body.model")
    if body.get("n", 1) != 1:
        raise BadInput("body.n", "only n=1 is served", line)
    if body.get("stream"):
        raise BadInput("body.stream", "a batch line does not stream", line)
    prefix, prompt = _completion_prompt(body, line) if url == COMPLETIONS_URL else _chat_prompt(body, line)
    max_tokens = _max_tokens(body, model, line, default_max_tokens)
    # The payload travels with the item to its result: what the OpenAI output format needs.
    payload: dict[str, Any] = {"custom_id": id_}
    if url == COMPLETIONS_URL:
        payload["url"] = url
    return _prepare(id_, model, prefix, prompt, None, max_tokens, payload, line)


def _completion_prompt(body: dict[str, Any], line: int | None) -> tuple[list[str], str]:
    """/v1/completions: body.prompt, a string (or a one-string list); no prefix."""
    if "messages" in body:
        raise BadInput("body.messages", f"{COMPLETIONS_URL} takes body.prompt, not messages", line)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # OpenAI accepts a one-string list
    if not isinstance(prompt, str):
        raise BadInput("body.prompt", f"must be a string, got {type(prompt).__name__}", line)
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
        role = _str(m, "role", line, f"body.messages[{i}].role")
        parts.append((role, _content(m.get("content"), line, f"body.messages[{i}].content")))
    return [f"{r}: {c}" for r, c in parts[:-1]], parts[-1][1]


def parse_line(raw: bytes | str, line: int | None = None,
               default_max_tokens: MaxTokensDefault | None = None) -> PreparedItem:
    """One input line as an item. ``default_max_tokens(model)`` gives the output cap of an OpenAI line
    without one (the model's ``default_max_tokens`` setting; DEFAULT_MAX_TOKENS when None)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if len(raw) > MAX_LINE_BYTES:
        raise BadInput("line", f"longer than {MAX_LINE_BYTES} bytes", line)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput("line", f"invalid UTF-8 at byte {e.start}", line) from None
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BadInput("line", f"not valid JSON ({e})", line) from None
    if not isinstance(obj, dict):
        raise BadInput("line", f"must be a JSON object, got {type(obj).__name__}", line)
    if "custom_id" in obj:
        return from_openai(obj, line, default_max_tokens)
    if "id" in obj:
        return from_native(obj, line)
    raise BadInput("format", "unknown format: expected a native item (with \"id\") or an OpenAI batch "
                   "line (with \"custom_id\")", line)
