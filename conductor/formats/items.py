"""An input line's item (``PreparedItem``) as its formats build it: its body (prompt and payload, the
payload bounded), its input tokens (given, or estimated) and its prefix's shape signature; and
``Facts``, what the check pass of a file keeps of a valid line.

When ``input_tokens`` is absent it is estimated as ``ceil(utf8_bytes(prefix + prompt) / 4)``
(at least 1), a common rule of thumb for English BPE vocabularies; producers that know their
tokenizer should send the real count.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import msgspec

from conductor.errors import BadInput
from conductor.formats.checks import MAX_INPUT_TOKENS, MAX_PAYLOAD_BYTES
from conductor.formats.signature import shape_signature
from conductor.redis_contract.records import PreparedItem

_json = msgspec.json.Encoder()


def estimate_tokens(prefix: list[str] | tuple[str, ...], prompt: str) -> int:
    return tokens_of_bytes(sum(len(p.encode("utf-8")) for p in prefix) + len(prompt.encode("utf-8")))


def tokens_of_bytes(n: int) -> int:
    """The estimate for ``n`` UTF-8 bytes of prefix and prompt: ceil(n / 4), at least 1."""
    return max(1, math.ceil(n / 4))


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


def prepare(id_: str, model: str, prefix: list[str], prompt: str, input_tokens: int | None,
            max_tokens: int, payload: Any, line: int | None) -> PreparedItem:
    body = _json.encode([prompt, payload])
    if payload is not None and len(body) - len(_json.encode([prompt, None])) > MAX_PAYLOAD_BYTES:
        raise BadInput("payload", f"larger than {MAX_PAYLOAD_BYTES} bytes", line)
    if input_tokens is None:
        input_tokens = min(estimate_tokens(prefix, prompt), MAX_INPUT_TOKENS)
    sig, parts = _signature(tuple(prefix))
    return PreparedItem(id=id_, model=model, sig=sig, input_tokens=input_tokens,
                        max_tokens=max_tokens, body=body, prefix=parts)


class Facts(NamedTuple):
    """What the check pass of a file keeps of a valid line (conductor/intake/input_files.py): its id,
    model and input tokens, and ``url``, the endpoint of an OpenAI request (None for a line that is
    not one), which the Batch API's check reads."""

    id: str
    model: str
    input_tokens: int
    url: str | None
