"""What a real engine is asked for one item: a chat or a completion, and its sampling options.

The item carries its prompt split for the broker (conductor/formats/openai_input.py): an OpenAI chat line
keeps every message but the last as a prefix component ``"role: content"`` and the last message's
content as the prompt; a completion line (payload ``url`` /v1/completions) and a native line keep
plain text. Engines that speak OpenAI's request shape (vLLM in process, any OpenAI-compatible
server) get the messages back, so the server's own chat template renders them exactly as for a
direct request; the shared system prompt then stays the leading tokens, which is what the prefix
cache keys on. The last message goes as the user's (the broker does not keep its role).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conductor.formats.openai_input import CHAT_URL, COMPLETIONS_URL
from conductor.formats.openai_options import request_options
from conductor.redis_contract.records import Batch, BatchItem

# The request options an engine passes on as sampling parameters (response_format of type text asks
# for nothing: conductor/formats/openai_options.py refuses every other kind).
SAMPLING_OPTIONS = ("temperature", "top_p", "seed", "stop")


@dataclass
class EngineRequest:
    """One item as an OpenAI-shaped request: ``messages`` for a chat, else ``prompt`` text."""

    url: str
    messages: list[dict[str, str]] | None
    prompt: str | None
    max_tokens: int
    options: dict[str, Any] = field(default_factory=dict)

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body of this request to an OpenAI-compatible endpoint (``url``)."""
        out: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, **self.options}
        if self.messages is not None:
            out["messages"] = self.messages
        else:
            out["prompt"] = self.prompt
        return out


def _message(component: str) -> dict[str, str]:
    role, sep, content = component.partition(": ")
    if not sep or not role or " " in role:
        return {"role": "system", "content": component}
    return {"role": role, "content": content}


def is_chat(item: BatchItem) -> bool:
    """An OpenAI chat line (its payload names its custom_id and no other endpoint)."""
    p = item.payload
    return isinstance(p, dict) and "custom_id" in p and p.get("url", CHAT_URL) == CHAT_URL


def joined_prompt(batch: Batch, item: BatchItem) -> str:
    """The plain-text prompt of a native or completion item: its prefix parts, one a line, then the prompt
    (the torch engine's rule, so every engine reads a native line the same way)."""
    return "\n".join(batch.prefix) + "\n" + item.prompt if batch.prefix else item.prompt


def request_of(batch: Batch, item: BatchItem) -> EngineRequest:
    """An OpenAI line's options as given (what it leaves out is the engine's default, as with a direct
    request); a native line carries none and decodes greedily, as it does on the torch engine."""
    opts = {k: v for k, v in request_options(item.payload).items() if k in SAMPLING_OPTIONS}
    if not (isinstance(item.payload, dict) and "custom_id" in item.payload):
        opts = {"temperature": 0.0}
    if is_chat(item):
        msgs = [_message(c) for c in batch.prefix] + [{"role": "user", "content": item.prompt}]
        return EngineRequest(CHAT_URL, msgs, None, item.max_tokens, opts)
    return EngineRequest(COMPLETIONS_URL, None, joined_prompt(batch, item), item.max_tokens, opts)
