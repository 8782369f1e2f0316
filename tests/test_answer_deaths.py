"""Each line of a batch answered once through the other deaths (issue 25): a worker SIGKILLed
mid-batch, Redis SIGKILLed and restarted with AOF (appendfsync always), and ``conductor serve``
SIGKILLed while it streams the output file (the next GET, from a restarted serve, is whole)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from openai import OpenAI

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.jobs import job_ledger
from tests.conftest import ROOT
from tests.helpers import wait_for
from tests.test_answer_ledger import KEY, start_serve
from tests.test_serve import jsonl, request


def _worker(url: str, *, size: int, time_scale: float) -> subprocess.Popen:
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url)
    return subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                             "--model", "m", "--create", "--max-batch-size", str(size), "--max-batch-tokens", "8192",
                             "--max-input-len", "256", "--sim-time-scale", str(time_scale), "--heartbeat-ttl", "1"],
                            env=env, cwd=str(ROOT))


def test_a_batch_answers_each_line_once_through_worker_redis_and_serve_deaths(fresh_server: EmbeddedRedis,
                                                                              tmp_path: Path) -> None:
    url, data = fresh_server.url, tmp_path / "files"
    c = Conductor(connect(url))
    c.set_config("m", {"quiet_ms": 100})
    serve, base = start_serve(url, data)
    slow = fast = None
    try:
        client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        rows = [request(i, max_tokens=8) for i in range(800)]
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        slow = _worker(url, size=8, time_scale=20.0)  # a batch of 8 takes a while: killed with one in flight
        wait_for(lambda: c.status(b.id)["completed"] >= 8, "the first worker completed nothing", 60)
        os.kill(slow.pid, signal.SIGKILL)
        slow.wait()
        fresh_server.kill()  # and Redis, at once; AOF with fsync always keeps every acknowledged write
        fresh_server.start()
        fast = _worker(url, size=64, time_scale=0.0)
        got: dict = {}

        def ended() -> bool:
            try:
                got["b"] = client.batches.retrieve(b.id)
            except Exception:  # noqa: BLE001 - serve reconnecting to the restarted Redis
                return False
            return got["b"].status in ("completed", "failed", "expired", "cancelled")
        wait_for(ended, "the batch did not end", 120)
        done = got["b"]
        assert done.status == "completed", done
        out = client.files.content(done.output_file_id).text.splitlines()
        err = client.files.content(done.error_file_id).text.splitlines() if done.error_file_id else []
        ids = [json.loads(x)["custom_id"] for x in out + err]
        assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # every line once
        assert (done.request_counts.total, done.request_counts.completed) == (800, len(out))
        led = job_ledger.build(c, b.id, str(data / f"{f.id}.jsonl"))
        assert led.clean and led.kinds["completed"] == len(out), led.render()
        # serve killed while it writes the output file out: the reader gets a cut file ...
        req = urllib.request.Request(f"{base}/v1/files/{done.output_file_id}/content",
                                     headers={"Authorization": f"Bearer {KEY}"})
        resp = urllib.request.urlopen(req, timeout=10)
        head = resp.read(4096)
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait()
        try:
            rest = resp.read()
        except Exception:  # noqa: BLE001 - a cut chunked stream
            rest = b""
        assert len(head + rest) <= len("\n".join(out)) + 1
        # ... and the next GET, from a serve started again, serves the whole file, every line once
        serve, base = start_serve(url, data)
        again = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        whole = again.files.content(done.output_file_id).text.splitlines()
        assert whole == out
    finally:
        for p in (serve, slow, fast):
            if p is not None and p.poll() is None:
                p.kill()  # the test is over: nothing it started outlives it
                p.wait(10)

