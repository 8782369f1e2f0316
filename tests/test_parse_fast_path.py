"""parse_line's fast paths (issue 25: a valid native line or plain chat request in one msgspec decode)
build exactly the item the field-by-field way builds, and leave every other line to it (which then
accepts it the same or refuses it naming the field)."""

from __future__ import annotations

import json

import pytest

from conductor.errors import BadInput
from conductor.formats.checks import MAX_PAYLOAD_BYTES
from conductor.formats.lines import facts_of, line_facts, parse_line
from conductor.formats.native import from_native, native_facts, native_fast
from conductor.formats.openai_input import MaxTokensDefault, chat_facts, from_openai, openai_fast
from conductor.redis_contract.records import PreparedItem

CHAT = "/v1/chat/completions"


def chat(**body: object) -> dict:
    b = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    return {"custom_id": "c1", "method": "POST", "url": CHAT, "body": {**b, **body}}


NATIVE = {"id": "a", "model": "m", "prefix": ["sys", "shots"], "prompt": "p\n\"q\"", "input_tokens": 7,
          "max_tokens": 5}
LINES = [
    NATIVE,
    {**NATIVE, "payload": {"k": [1, 2.5, None]}},
    {k: v for k, v in NATIVE.items() if k != "input_tokens"},  # tokens estimated
    {**NATIVE, "input_tokens": None},
    {**NATIVE, "prefix": []},
    {k: v for k, v in NATIVE.items() if k != "prefix"},
    {**NATIVE, "id": "é" * 200},  # over the fast path's length bound: the slow one measures bytes
    chat(),
    chat(max_tokens=9),
    chat(max_completion_tokens=9),
    chat(max_tokens=9, max_completion_tokens=9),
    chat(messages=[{"role": "user", "content": ""}]),
    chat(messages=[{"role": "user", "content": "x", "name": "bob"}]),  # extra message fields are ignored
    chat(temperature=0.5),  # an option: the slow way carries it
    {**chat(), "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}},
    chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}]),
]
REFUSED = [
    {**NATIVE, "max_tokens": True}, {**NATIVE, "max_tokens": 5.0}, {**NATIVE, "max_tokens": 0},
    {**NATIVE, "extra": 1}, {**NATIVE, "id": ""}, {**NATIVE, "model": "bad model"}, {**NATIVE, "prefix": None},
    chat(max_tokens=9, max_completion_tokens=10), chat(max_tokens=0), chat(messages=[]), {**chat(), "method": "GET"},
    {**chat(), "url": "/v1/embeddings"}, {**chat(), "custom_id": ""}, chat(model="bad model"), chat(n=2),
]


def slow(obj: dict, default: MaxTokensDefault | None) -> PreparedItem:
    return from_openai(obj, None, default) if "custom_id" in obj else from_native(obj, None)


@pytest.mark.parametrize("obj", LINES)
def test_a_fast_item_is_the_slow_one(obj):
    def default(model: str) -> int:
        return 77
    assert parse_line(json.dumps(obj), 1, default) == slow(obj, default)


@pytest.mark.parametrize("obj", REFUSED)
def test_a_line_the_slow_way_refuses_is_refused(obj):
    with pytest.raises(BadInput) as slow_error:
        slow(obj, None)
    with pytest.raises(BadInput) as fast_error:
        parse_line(json.dumps(obj), 3)
    assert (fast_error.value.field, fast_error.value.line) == (slow_error.value.field, 3)


def test_the_fast_paths_take_the_common_forms():
    assert native_fast(json.dumps(NATIVE).encode()) is not None
    assert openai_fast(json.dumps(chat()).encode(), None) is not None
    assert openai_fast(json.dumps(chat(temperature=0.5)).encode(), None) is None


def test_line_facts_are_the_built_items_facts():
    """The check pass's light path (conductor.formats.lines.line_facts) accepts a line exactly when parse_line does,
    with the id, model, input tokens and endpoint of the item parse_line builds."""
    asked: list[str] = []

    def default(model: str) -> int:
        asked.append(model)
        return 77
    lines = [*LINES, {**NATIVE, "payload": {"custom_id": "a", "url": "/v1/completions"}},
             {**NATIVE, "payload": {"custom_id": "other"}}, {**NATIVE, "payload": "x" * (MAX_PAYLOAD_BYTES + 2)},
             {**NATIVE, "prompt": "é" * 9, "input_tokens": None}, chat(messages=[{"role": "user", "content": "ü" * 7}])]
    for obj in lines:
        raw = json.dumps(obj, ensure_ascii=False).encode()
        asked.clear()
        facts = line_facts(raw, 1, default)
        light_asked = list(asked)
        asked.clear()
        it = parse_line(raw, 1, default)
        assert facts == facts_of(it), obj
        assert light_asked == asked, obj  # the model defaults asked the same (a task records them)
    for obj in [*REFUSED, {**NATIVE, "payload": "x" * (MAX_PAYLOAD_BYTES + 3)}]:
        with pytest.raises(BadInput) as light_error:
            line_facts(json.dumps(obj).encode(), 3)
        with pytest.raises(BadInput) as full_error:
            parse_line(json.dumps(obj).encode(), 3)
        assert (light_error.value.field, str(light_error.value)) == (full_error.value.field, str(full_error.value))


def test_the_light_paths_take_the_common_forms():
    assert native_facts(json.dumps(NATIVE).encode()) is not None
    assert chat_facts(json.dumps(chat()).encode(), None) is not None
    assert chat_facts(json.dumps(chat(temperature=0.5)).encode(), None) is None
