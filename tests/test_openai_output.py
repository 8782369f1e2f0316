"""``conductor results J --format openai``: OpenAI batch output lines that the official SDK's types
parse, one per custom_id, failures in the error file (issue 17)."""

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.conftest import cli


def test_results_in_openai_format_parse_with_the_sdk_types(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": [{"type": "text", "text": f"q{i}"}]}]}}
            for i in range(6)]
    rows += [{"custom_id": f"text-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": f"once {i}", "max_tokens": 4}} for i in range(3)]
    # Longer than the worker's --max-input-len: a per-item error, which goes to the error file.
    rows.append({"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 2000}]}})
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    native = tmp_path / "native.jsonl"
    cli("run", str(src), "--engine", "sim", "--workers", "1", "--max-input-len", "256", "--job", "oa",
        "-o", str(native), url=redis_url, timeout=120)
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    cli("results", "oa", "--format", "openai", "-o", str(out), "--errors", str(err), url=redis_url)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    errors = [json.loads(x) for x in err.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(r["custom_id"] for r in rows[:-1])
    assert [x["custom_id"] for x in errors] == ["too-long"]
    assert errors[0]["response"] is None and errors[0]["error"]["code"] and errors[0]["error"]["message"]
    for x in lines:
        assert x["error"] is None and x["id"].startswith("batch_req_")
        resp = x["response"]
        assert resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        if x["custom_id"].startswith("chat-"):
            cc = ChatCompletion.model_validate(body)
            assert cc.object == "chat.completion" and cc.choices[0].message.role == "assistant"
            assert cc.usage.total_tokens == cc.usage.prompt_tokens + cc.usage.completion_tokens
            assert cc.usage.completion_tokens >= 1
        else:
            tc = Completion.model_validate(body)
            assert tc.object == "text_completion" and tc.usage.completion_tokens <= 4
    # Without --errors, one file holds every line; the same bytes on a second read.
    once = cli("results", "oa", "--format", "openai", url=redis_url).stdout
    assert len(once.splitlines()) == len(rows)
    assert cli("results", "oa", "--format", "openai", url=redis_url).stdout == once
    p = cli("results", "oa", "--errors", str(err), url=redis_url, check=False)
    assert p.returncode == 2 and b"--errors goes with --format openai" in p.stderr
