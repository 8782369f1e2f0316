"""OpenAI batch input lines as OpenAI's clients write them (issue 17): max_tokens optional,
max_completion_tokens, content as text parts, the url checked against the endpoints served."""

import json

import pytest

from conductor.client import connect
from conductor.errors import BadInput
from conductor.formats.lines import parse_line
from conductor.formats.openai_input import DEFAULT_MAX_TOKENS
from conductor.redis_contract.keys import ModelKeys
from tests.conftest import cli


def line(body: dict, url: str = "/v1/chat/completions", **extra) -> str:
    return json.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body, **extra})


def chat(**body) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hi"}], **body}


def test_max_tokens_is_optional_and_takes_the_models_default():
    # Before: "body.max_completion_tokens: must be an integer, got NoneType"
    assert parse_line(line(chat())).max_tokens == DEFAULT_MAX_TOKENS
    assert parse_line(line(chat()), 1, lambda model: 77).max_tokens == 77
    assert parse_line(line(chat(max_completion_tokens=9))).max_tokens == 9
    assert parse_line(line(chat(max_tokens=9, max_completion_tokens=9))).max_tokens == 9
    with pytest.raises(BadInput) as e:
        parse_line(line(chat(max_tokens=9, max_completion_tokens=10)), 4)
    assert str(e.value).startswith("line 4: body.max_tokens")


def test_content_as_text_parts_is_the_same_item_as_a_string():
    parts = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]}
    plain = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "h\ni"}]}
    a, b = parse_line(line(parts)), parse_line(line(plain))
    assert (a.sig, a.body, a.prefix) == (b.sig, b.body, b.prefix)
    image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(BadInput) as e:
        parse_line(line(image), 3)
    assert e.value.field == "body.messages[0].content[0]" and e.value.line == 3


def test_url_is_checked_against_the_endpoints_served():
    # Before: an embeddings line was accepted and run as a chat completion.
    with pytest.raises(BadInput) as e:
        parse_line(line({"model": "m", "input": "x"}, url="/v1/embeddings"), 2)
    assert e.value.field == "url" and "/v1/chat/completions" in str(e.value)
    done = parse_line(line({"model": "m", "prompt": "Once upon", "max_tokens": 3}, url="/v1/completions"))
    assert done.prefix == () and json.loads(done.body) == ["Once upon", {"custom_id": "c1", "url": "/v1/completions"}]
    for body, url, field in [({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "/v1/completions",
                              "body.messages"),
                             ({"model": "m", "prompt": "x"}, "/v1/chat/completions", "body.prompt"),
                             ({"model": "m", "prompt": 5}, "/v1/completions", "body.prompt")]:
        with pytest.raises(BadInput) as e:
            parse_line(line(body, url=url), 1)
        assert e.value.field == field
    for extra, field in [({"method": "GET"}, "method"), ({"extra": 1}, "extra")]:
        with pytest.raises(BadInput) as e:
            parse_line(line(chat(), **extra), 1)
        assert e.value.field == field
    with pytest.raises(BadInput) as e:
        parse_line(line(chat(n=2)), 1)
    assert e.value.field == "body.n"


def test_submit_takes_the_models_default_max_tokens_from_its_config(redis_url, tmp_path):
    r = connect(redis_url)
    r.hset(ModelKeys("m").cfg, "default_max_tokens", 33)
    src = tmp_path / "in.jsonl"
    src.write_text(line(chat()) + "\n" + line(chat(), url="/v1/embeddings").replace("c1", "c2") + "\n")
    p = cli("submit", "--create", str(src), "--job", "oa", url=redis_url, check=False)
    assert p.returncode == 2 and b"line 2: url: '/v1/embeddings' is not served" in p.stderr
    src.write_text(line(chat()) + "\n")
    cli("submit", "--create", str(src), "--job", "oa", url=redis_url)
    lanes = [k for k in r.scan_iter(match="cdr:{m}:lane:*")]
    assert len(lanes) == 1 and json.loads(r.lindex(lanes[0], 0))[3] == 33
    r.close()
