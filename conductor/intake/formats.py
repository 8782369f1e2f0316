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

Request options of an OpenAI line (``temperature``, ``top_p``, ``stop``, ``seed``,
``response_format`` of type text) travel with the item in its payload, under ``"options"``, to the
engine, which honours what it can (``request_options``; docs/formats.md, "Request options"). An option no
engine here can honour (``n`` > 1, ``logprobs``, tools, a JSON ``response_format``, a penalty) is
refused with its field named; a field this module does not know is refused too, so that nothing a
caller asked for is silently dropped.

When ``input_tokens`` is absent it is estimated as ``ceil(utf8_bytes(prefix + prompt) / 4)``
(at least 1), a common rule of thumb for English BPE vocabularies; producers that know their
tokenizer should send the real count.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

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
    return tokens_of_bytes(sum(len(p.encode("utf-8")) for p in prefix) + len(prompt.encode("utf-8")))


def tokens_of_bytes(n: int) -> int:
    """The estimate for ``n`` UTF-8 bytes of prefix and prompt: ceil(n / 4), at least 1."""
    return max(1, math.ceil(n / 4))


_JSON_KINDS = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
               dict: "an object", type(None): "null"}


def kind(v: Any) -> str:
    """A value's JSON kind, as the line's author wrote it ("a string", "null"), not Python's type."""
    return _JSON_KINDS.get(type(v), type(v).__name__)


def _missing(obj: dict[str, Any], field: str, name: str, line: int | None) -> None:
    if field not in obj:
        raise BadInput(name, "missing", line)


def _int(obj: dict[str, Any], field: str, lo: int, hi: int, line: int | None, name: str | None = None) -> int:
    v = obj.get(field)
    name = name or field
    _missing(obj, field, name, line)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(name, f"must be an integer, got {kind(v)}", line)
    if v < lo or v > hi:
        raise BadInput(name, f"must be between {lo} and {hi}, got {v}", line)
    return v


def _str(obj: dict[str, Any], field: str, line: int | None, name: str | None = None, allow_empty: bool = True) -> str:
    v = obj.get(field)
    name = name or field
    _missing(obj, field, name, line)
    if not isinstance(v, str):
        raise BadInput(name, f"must be a string, got {kind(v)}", line)
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


# A file's lines share a few prefixes: each one's signature and one copy of it are remembered
# (bounded; cleared when full), so that items kept in memory share their prefix.
_SIGS: dict[tuple[str, ...], tuple[str, tuple[str, ...]]] = {}
_SIGS_MAX = 4096


def _signature(prefix: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    known = _SIGS.get(prefix)
    if known is None:
        if len(_SIGS) >= _SIGS_MAX:
            _SIGS.clear()
        known = _SIGS[prefix] = (shape_signature(prefix), prefix)
    return known


def _prepare(id_: str, model: str, prefix: list[str], prompt: str, input_tokens: int | None,
             max_tokens: int, payload: Any, line: int | None) -> PreparedItem:
    body = _json.encode([prompt, payload])
    if payload is not None and len(body) - len(_json.encode([prompt, None])) > MAX_PAYLOAD_BYTES:
        raise BadInput("payload", f"larger than {MAX_PAYLOAD_BYTES} bytes", line)
    if input_tokens is None:
        input_tokens = min(estimate_tokens(prefix, prompt), MAX_INPUT_TOKENS)
    sig, parts = _signature(tuple(prefix))
    return PreparedItem(id=id_, model=model, sig=sig, input_tokens=input_tokens,
                        max_tokens=max_tokens, body=body, prefix=parts)


_GOOD_NAMES: set[str] = set()  # model names seen valid (a file names a few): checked once each


def _name_ok(v: str) -> bool:
    if v in _GOOD_NAMES:
        return True
    try:
        check_name("model", v)
    except ValueError:
        return False
    if len(_GOOD_NAMES) < 1024:
        _GOOD_NAMES.add(v)
    return True


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
    aside: ``_prepare`` measures it); None for any other line."""
    try:
        n = _native.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    tok = n.input_tokens
    if not (n.id and len(n.id) <= MAX_ID_BYTES // 4 and 1 <= n.max_tokens <= MAX_OUTPUT_TOKENS
            and (tok is None or 1 <= tok <= MAX_INPUT_TOKENS) and len(n.prefix) <= MAX_PREFIX_PARTS
            and _name_ok(n.model)):
        return None
    return n


def _native_fast(raw: bytes) -> PreparedItem | None:
    """The item of a valid native line, the same as ``from_native`` makes; None for any line
    ``from_native`` might refuse (it then says why)."""
    n = _native_checked(raw)
    if n is None:
        return None
    try:  # one copy of a model's name for the items of a file (the check keeps many of them)
        return _prepare(n.id, sys.intern(n.model), n.prefix, n.prompt, n.input_tokens, n.max_tokens, n.payload, None)
    except BadInput:
        return None


def from_native(obj: dict[str, Any], line: int | None = None) -> PreparedItem:
    unknown = set(obj) - _NATIVE_FIELDS
    if unknown:
        raise BadInput(sorted(unknown)[0], "unknown field (native format fields: "
                       + ", ".join(sorted(_NATIVE_FIELDS)) + ")", line)
    id_ = _check_id(_str(obj, "id", line), line)
    model = _check_model(_str(obj, "model", line), line)
    prefix = obj.get("prefix", [])
    if not isinstance(prefix, list):
        raise BadInput("prefix", f"must be a list of strings, got {kind(prefix)}", line)
    if len(prefix) > MAX_PREFIX_PARTS:
        raise BadInput("prefix", f"more than {MAX_PREFIX_PARTS} components", line)
    for i, p in enumerate(prefix):
        if not isinstance(p, str):
            raise BadInput(f"prefix[{i}]", f"must be a string, got {kind(p)}", line)
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
        raise BadInput(name, f"must be a string or a non-empty list of text parts, got {kind(v)}", line)
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
    return _prepare(id_, model, prefix, prompt, None, max_tokens, payload, line)


# The body fields of a request line: what makes the item, the options carried to the engine, and
# those accepted only at the value that asks for nothing (OpenAI's clients send some by default).
_BODY_ITEM = frozenset({"model", "messages", "prompt", "max_tokens", "max_completion_tokens"})
CARRIED_OPTIONS = ("temperature", "top_p", "stop", "seed", "response_format")
_NEUTRAL: dict[str, Any] = {"n": 1, "stream": False, "frequency_penalty": 0, "presence_penalty": 0,
                             "logit_bias": {}, "logprobs": False, "top_logprobs": 0, "tools": [], "functions": [],
                             "tool_choice": "none", "parallel_tool_calls": None, "stream_options": None}
_WHY_NOT = {"n": "only n=1 is served", "stream": "a batch line does not stream"}
_NO_EFFECT = frozenset({"user", "metadata", "store"})  # identify the request; no engine's answer depends on them
MAX_STOP = 4
_SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)


def request_options_of(body: dict[str, Any], line: int | None = None) -> dict[str, Any]:
    """The options of a request body an engine is to honour, checked; a field no engine here honours
    is refused with its name (``body.logprobs``), never dropped. Null is an absent field."""
    out: dict[str, Any] = {}
    for name, v in body.items():
        field = f"body.{name}"
        if v is None or name in _BODY_ITEM or name in _NO_EFFECT:
            continue
        if name in _NEUTRAL:
            # parallel_tool_calls means nothing without tools
            if name != "parallel_tool_calls" and not _same(v, _NEUTRAL[name]):
                raise BadInput(field, _WHY_NOT.get(name, f"not served: no engine here honours {name} "
                                                         "(docs/formats.md)"), line)
            continue
        check = _OPTION_CHECKS.get(name)
        if check is None:
            served = ", ".join(sorted(_BODY_ITEM | set(CARRIED_OPTIONS) | _NO_EFFECT))
            raise BadInput(field, f"not served (body fields: {served}; docs/formats.md)", line)
        value = check(v, field, line)
        if value is not None:
            out[name] = value
    return out


def _temperature(v: Any, field: str, line: int | None) -> float:
    return _number(v, 0.0, 2.0, field, line)


def _top_p(v: Any, field: str, line: int | None) -> float:
    p = _number(v, 0.0, 1.0, field, line)
    if p == 0:
        raise BadInput(field, "must be above 0", line)
    return p


def _seed(v: Any, field: str, line: int | None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not _SEED_RANGE[0] <= v <= _SEED_RANGE[1]:
        raise BadInput(field, f"must be a 64-bit integer, got {kind(v)}", line)
    return v


def _stop(v: Any, field: str, line: int | None) -> list[str] | None:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(x, str) and x for x in stops):
        raise BadInput(field, f"must be a non-empty string or a list of at most {MAX_STOP} of them", line)
    return stops or None


def _response_format(v: Any, field: str, line: int | None) -> None:
    """{"type": "text"} is what every engine gives (nothing to carry); JSON output is refused."""
    if not isinstance(v, dict) or v.get("type") != "text" or set(v) != {"type"}:
        raise BadInput(field, 'only {"type": "text"} is served: no engine here constrains its output to JSON', line)


_OPTION_CHECKS: dict[str, Callable[[Any, str, int | None], Any]] = {
    "temperature": _temperature, "top_p": _top_p, "seed": _seed, "stop": _stop, "response_format": _response_format}


def _same(v: Any, neutral: Any) -> bool:
    """``v`` asks for what ``neutral`` does (True is not 1 here, nor 0.0 False)."""
    return v == neutral and (type(v) is bool) == (type(neutral) is bool)


def _number(v: Any, lo: float, hi: float, field: str, line: int | None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise BadInput(field, f"must be a number from {lo:g} to {hi:g}, got {v!r}", line)
    return float(v)


def request_options(payload: Any) -> dict[str, Any]:
    """The request options an item carries (in its payload, as ``from_openai`` stores them); {} for
    an item without (a native line)."""
    if isinstance(payload, dict) and "custom_id" in payload:
        opts = payload.get("options")
        if isinstance(opts, dict):
            return opts
    return {}


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
        role = _str(m, "role", line, f"body.messages[{i}].role")
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
            and 1 <= len(msgs) <= MAX_PREFIX_PARTS + 1 and _name_ok(b.model)):
        return None
    given = [v for v in (b.max_completion_tokens, b.max_tokens) if v is not None]
    if len(given) == 2 and given[0] != given[1]:
        return None
    if given and not 1 <= given[0] <= MAX_OUTPUT_TOKENS:
        return None
    model = sys.intern(b.model)
    max_tokens = given[0] if given else default_max_tokens(model) if default_max_tokens else DEFAULT_MAX_TOKENS
    return line, model, max_tokens


def _openai_fast(raw: bytes, default_max_tokens: MaxTokensDefault | None) -> PreparedItem | None:
    """The item of a plain chat request line, the same as ``from_openai`` makes; None for any line
    ``from_openai`` might refuse or read otherwise."""
    checked = _chat_checked(raw, default_max_tokens)
    if checked is None:
        return None
    line, model, max_tokens = checked
    msgs, id_ = line.body.messages, line.custom_id
    prefix = [f"{m.role}: {m.content}" for m in msgs[:-1]]
    try:
        return _prepare(id_, model, prefix, msgs[-1].content, None, max_tokens, {"custom_id": id_}, None)
    except BadInput:
        return None


class Facts(NamedTuple):
    """What the check pass of a file keeps of a valid line (conductor/intake/input_files.py): its id,
    model and input tokens, and ``url``, the endpoint of an OpenAI request (None for a line that is
    not one), which the Batch API's check reads."""

    id: str
    model: str
    input_tokens: int
    url: str | None


def facts_of(it: PreparedItem) -> Facts:
    """The facts of an item already built (its payload read as from_openai writes it)."""
    if it.body.endswith(b',{"custom_id":' + _json.encode(it.id) + b"}]"):
        return Facts(it.id, it.model, it.input_tokens, CHAT_URL)  # a chat request without options
    payload = msgspec.json.decode(it.body)[1]
    return Facts(it.id, it.model, it.input_tokens, _request_url(payload, it.id))


def _request_url(payload: Any, id_: str) -> str | None:
    if not isinstance(payload, dict) or payload.get("custom_id") != id_:
        return None
    return str(payload.get("url", CHAT_URL))


def _native_facts(raw: bytes) -> Facts | None:
    """``_native_fast`` without building the item: the same decode and the same bounds, and the
    payload's size measured as ``_prepare`` measures it; None where ``_native_fast`` gives None."""
    n = _native_checked(raw)
    if n is None:
        return None
    if n.payload is not None and len(_json.encode(n.payload)) - 4 > MAX_PAYLOAD_BYTES:
        return None  # _prepare refuses it, naming the payload
    tok = n.input_tokens
    if tok is None:
        tok = min(estimate_tokens(n.prefix, n.prompt), MAX_INPUT_TOKENS)
    return Facts(n.id, sys.intern(n.model), tok, _request_url(n.payload, n.id))


def _chat_facts(raw: bytes, default_max_tokens: MaxTokensDefault | None) -> Facts | None:
    """``_openai_fast`` without building the item (its token estimate counts the same bytes)."""
    checked = _chat_checked(raw, default_max_tokens)
    if checked is None:
        return None
    line, model, _ = checked
    msgs = line.body.messages
    size = sum(len(m.role.encode("utf-8")) + 2 + len(m.content.encode("utf-8")) for m in msgs[:-1])
    size += len(msgs[-1].content.encode("utf-8"))
    return Facts(line.custom_id, model, min(tokens_of_bytes(size), MAX_INPUT_TOKENS), CHAT_URL)


_BOM = b"\xef\xbb\xbf"


def line_facts(raw: bytes, line: int | None = None, default_max_tokens: MaxTokensDefault | None = None) -> Facts:
    """What ``parse_line`` checks of a line, without building its item for the common forms (a
    third of the time: a file's check pass runs before its first write, while Redis idles; the send
    pass builds the items while Redis runs the chunk before). A line accepted here is one
    ``parse_line`` accepts with these facts; any other goes through ``parse_line``, which refuses it
    naming the field, or builds it."""
    if len(raw) <= MAX_LINE_BYTES and not raw.startswith(_BOM):
        light = _native_facts(raw) if b'"custom_id"' not in raw else _chat_facts(raw, default_max_tokens)
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
    fast = _native_fast(raw) if b'"custom_id"' not in raw else _openai_fast(raw, default_max_tokens)
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
