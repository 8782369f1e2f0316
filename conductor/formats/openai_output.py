"""Result lines in OpenAI's batch output format (``conductor results J --format openai``, the
output and error files of ``conductor serve``).

One line per result: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``. A result without an error has status 200 and a ``chat.completion`` body (a
``text_completion`` one for a ``/v1/completions`` line, whose payload says so: openai_input.py) with
``usage``; a failed one has ``response: null`` and ``error: {"code", "message"}``, and goes to the
error file, as OpenAI splits them. Ids are derived from the job and item, so reading a job's
results twice writes the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import msgspec

from conductor.formats.openai_input import COMPLETIONS_URL

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


def _hid(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def custom_id(res: dict[str, Any]) -> str:
    payload = res.get("payload")
    if isinstance(payload, dict) and isinstance(payload.get("custom_id"), str):
        return str(payload["custom_id"])
    return str(res["id"])  # a native line: its id plays the part


def _body(res: dict[str, Any], req: str) -> dict[str, Any]:
    raw = res.get("payload")
    payload: dict[str, Any] = raw if isinstance(raw, dict) else {}
    created = int(res.get("finished_at") or 0) // 1000
    prompt_t, out_t = int(res.get("input_tokens") or 0), int(res.get("output_tokens") or 0)
    usage = {"prompt_tokens": prompt_t, "completion_tokens": out_t, "total_tokens": prompt_t + out_t}
    if payload.get("url") == COMPLETIONS_URL:
        return {"id": f"cmpl-{req}", "object": "text_completion", "created": created, "model": res["model"],
                "choices": [{"text": res.get("output", ""), "index": 0, "logprobs": None, "finish_reason": "stop"}],
                "usage": usage}
    return {"id": f"chatcmpl-{req}", "object": "chat.completion", "created": created, "model": res["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.get("output", ""),
                                                 "refusal": None},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": usage}


def output_line(res: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """One native result (as ``conductor results`` prints it) as an OpenAI output line; True when it
    failed (it belongs in the error file)."""
    cid = custom_id(res)
    req = _hid(res.get("job", ""), res["id"])
    line: dict[str, Any] = {"id": f"batch_req_{req}", "custom_id": cid, "response": None, "error": None}
    err = res.get("error")
    if err:
        line["error"] = {"code": str(err.get("code", "error")), "message": str(err.get("message", ""))}
        return line, True
    line["response"] = {"status_code": 200, "request_id": f"req_{req}", "body": _body(res, req)}
    return line, False


class Sink(Protocol):
    def write(self, data: bytes, /) -> Any: ...


def write_openai(records: Iterable[bytes], out: Sink, errors: Sink | None) -> tuple[int, int]:
    """Native result records to OpenAI lines: successes to ``out``; failures to ``errors``, or to
    ``out`` when no error file is given. Returns (lines written to out, lines written to errors)."""
    n_out = n_err = 0
    for line, failed in converted(records):
        if failed and errors is not None:
            errors.write(_enc.encode(line) + b"\n")
            n_err += 1
        else:
            out.write(_enc.encode(line) + b"\n")
            n_out += 1
    return n_out, n_err


def converted(records: Iterable[bytes]) -> Iterator[tuple[dict[str, Any], bool]]:
    for rec in records:
        yield output_line(_dec.decode(rec))
