"""The request options of an OpenAI line (``temperature``, ``top_p``, ``stop``, ``seed``,
``response_format`` of type text): checked here, they travel with the item in its payload, under
``"options"``, to the engine, which honours what it can (``request_options``; README: "Request
options"). An option no engine here can honour (``n`` > 1, ``logprobs``, tools, a JSON
``response_format``, a penalty) is refused with its field named; a field this module does not
know is refused too, so that nothing a caller asked for is silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conductor.errors import BadInput
from conductor.formats.checks import kind

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
                                                         "(README: Request options)"), line)
            continue
        check = _OPTION_CHECKS.get(name)
        if check is None:
            served = ", ".join(sorted(_BODY_ITEM | set(CARRIED_OPTIONS) | _NO_EFFECT))
            raise BadInput(field, f"not served (body fields: {served}; README: Request options)", line)
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
