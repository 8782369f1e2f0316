"""``conductor serve`` driven by the official ``openai`` SDK (issue 17): a real serve process, a real
redis-server and real sim worker processes. Upload, create, follow to completed, download output
and error files (every custom_id once), cancel mid-run, list, bad input lines, a wrong key."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import redis
from openai import OpenAI

from conductor.embedded import free_port
from tests.conftest import ROOT

KEY = "sk-test-conductor"


def get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def request(i: int, *, url: str = "/v1/chat/completions", model: str = "m", **body) -> dict:
    if url == "/v1/completions":
        b = {"model": model, "prompt": f"once {i}", "max_tokens": 4}
    else:
        b = {"model": model, "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": f"question {i}"}]}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": {**b, **body}}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def served(url: str, *models: str) -> None:
    """The models a fleet serves, known to Redis before a batch names them (as a worker started with
    --create makes its model): the Batch API refuses a line for a model Redis does not know."""
    from conductor.client import Conductor, connect
    r = connect(url)
    try:
        c = Conductor(r)
        for m in models or ("m",):
            c.ensure_model(m)
    finally:
        r.close()  # no socket left to the garbage collector (a ResourceWarning in whichever test comes next)


@pytest.fixture()
def serve(redis_url, tmp_path) -> Iterator[str]:
    served(redis_url)
    port = free_port()
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url, CONDUCTOR_API_KEYS=f"other-key,{KEY}")
    p = subprocess.Popen([sys.executable, "-m", "conductor", "serve", "--port", str(port),
                          "--data-dir", str(tmp_path / "files")], env=env, cwd=str(ROOT))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            get(base + "/", KEY)
            break
        except OSError:
            assert p.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.1)
    yield base
    p.terminate()
    assert p.wait(10) == 0  # a clean stop, not death by SIGTERM (issue 27)


def worker(redis_url: str, *, size: int = 8, time_scale: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url)
    return subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine",
                             "sim", "--model", "m", "--max-batch-size", str(size), "--max-batch-tokens", "8192",
                             "--max-input-len", "256", "--sim-time-scale", str(time_scale)], env=env, cwd=str(ROOT))


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    assert p.wait(30) == 0


def follow(client: OpenAI, batch_id: str, until: set[str], timeout: float = 60):  # noqa: ANN201
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, f"batch stayed {b.status}: {b}"
        time.sleep(0.2)


def lines_of(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_sdk_runs_a_batch_end_to_end(serve, redis_url):
    client = OpenAI(base_url=serve + "/v1", api_key=KEY)
    rows = [request(i) for i in range(40)]
    rows[3]["body"]["messages"][1]["content"] = "x" * 3000  # over the worker's input length: a failed line
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(jsonl(rows))
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    assert client.files.content(f.id).content == jsonl(rows)
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"team": "eval", "tenant": "eval-team"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"team": "eval", "tenant": "eval-team"}
    w = worker(redis_url)
    try:
        b = follow(client, b.id, {"completed", "failed"})
    finally:
        stop(w)
    assert b.status == "completed", b.errors
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (40, 39, 1)
    # metadata.tenant billed the batch to that tenant (issue 26), due at the end of its window
    cls = redis.Redis.from_url(redis_url).hmget(f"cdr:{{m}}:in:{b.id}", "tenant", "deadline_ms")
    assert cls[0] == b"eval-team" and abs(int(cls[1]) / 1000 - (b.created_at + 86400)) < 60
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # every custom_id once
    assert [x["custom_id"] for x in err] == ["req-3"] and err[0]["error"]["message"]
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] >= 1
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)
    assert client.files.retrieve(b.output_file_id).bytes == len(client.files.content(b.output_file_id).content)
    # listed, newest first, with cursor pagination
    b2 = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    page = client.batches.list(limit=1)
    assert [x.id for x in page.data] == [b2.id] and page.has_more
    assert [x.id for x in client.batches.list(limit=1, after=b2.id).data] == [b.id]
    assert {x.id for x in client.batches.list()} >= {b.id, b2.id}
    assert f.id in {x.id for x in client.files.list()}
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_sdk_cancels_a_batch_mid_run_and_reads_its_files(serve, redis_url):
    client = OpenAI(base_url=serve + "/v1", api_key=KEY)
    rows = [request(i, url="/v1/completions") for i in range(200)]
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    w = worker(redis_url, size=4, time_scale=50.0)  # a batch of 4 takes about a second: cancelled mid-run
    try:
        deadline = time.monotonic() + 60
        while client.batches.retrieve(b.id).request_counts.completed < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        c = client.batches.cancel(b.id)
        assert c.status in ("cancelling", "cancelled") and c.cancelling_at
        b = follow(client, b.id, {"cancelled"})
    finally:
        stop(w)
    rc = b.request_counts
    assert rc.total == 200 and rc.completed + rc.failed == 200 and 4 <= rc.completed < 200
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows)
    assert len(out) == rc.completed and {x["error"]["code"] for x in err} == {"cancelled"}
    assert all(x["response"]["body"]["object"] == "text_completion" for x in out)
    assert client.batches.cancel(b.id).status == "cancelled"  # again: nothing changes
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")


def test_bad_lines_fail_the_batch_naming_each_line_and_field(serve):
    client = OpenAI(base_url=serve + "/v1", api_key=KEY)
    rows = [request(0), request(1, url="/v1/embeddings"), request(2, max_tokens="many"), request(3),
            request(4, url="/v1/completions")]
    rows[3]["custom_id"] = "req-0"
    f = client.files.create(file=("bad.jsonl", io.BytesIO(jsonl(rows) + b"{not json\n")), purpose="batch")
    b = follow(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id, {"failed"})
    assert b.failed_at and b.output_file_id is None
    got = [(e.line, e.param) for e in b.errors.data]
    assert got == [(2, "url"), (3, "body.max_tokens"), (4, "custom_id"), (5, "url"), (6, "line")], b.errors
    assert all(e.code and e.message for e in b.errors.data)
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")


def test_a_wrong_key_gets_401(serve):
    with pytest.raises(openai.AuthenticationError) as e:
        OpenAI(base_url=serve + "/v1", api_key="sk-wrong-key").files.list()
    assert e.value.status_code == 401 and "Incorrect API key" in str(e.value)
    assert get(serve + "/")[0] == 401


def test_status_page_shows_a_running_job(serve, redis_url):
    client = OpenAI(base_url=serve + "/v1", api_key=KEY)
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([request(i) for i in range(30)]))), purpose="batch")
    b = follow(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id, {"in_progress"})
    status, page = get(serve + "/", KEY)
    assert status == 200
    assert f'<tr id="job-{b.id}"><td>{b.id}</td><td>in_progress</td>' in page
    assert "<h2>Models</h2>" in page and "<td>m</td><td>30</td>" in page


def _chromium() -> str | None:
    import shutil
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_status_page_in_headless_chromium(serve, tmp_path):
    """The page as a browser renders it: a screenshot is taken, and the DOM Chromium built holds the
    running job's row."""
    client = OpenAI(base_url=serve + "/v1", api_key=KEY)
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([request(i) for i in range(12)]))), purpose="batch")
    b = follow(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id, {"in_progress"})
    assert _chromium(), "Chromium is missing: .ci/run installs Debian's chromium package"
    url = f"{serve}/?key={KEY}"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path}/ud"]
    shot = tmp_path / "status.png"
    subprocess.run([_chromium(), *flags, f"--screenshot={shot}", "--window-size=1200,800", url],
                   capture_output=True, timeout=90, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    dom = subprocess.run([_chromium(), *flags, "--dump-dom", url], capture_output=True, timeout=90, check=True)
    page = dom.stdout.decode()
    assert f'id="job-{b.id}"' in page and "in_progress" in page.split(f'id="job-{b.id}"', 1)[1][:200]
