"""Every input line answered exactly once (issue 25): cancel and expiry in each state of a batch
(validating, in_progress, finalizing), the lines never submitted answered from the kept input, the
request counts equal to the files and to the job ledger (``conductor verify-job``), and retry.

One real ``conductor serve`` for the module, driven by the official ``openai`` SDK; items are run by
claiming and completing in this process (tests/helpers.py drain), which is what a worker does."""

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
from pathlib import Path

import pytest
from openai import OpenAI

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis, free_port
from conductor.intake.file_intake import prepare_job
from conductor.intake.input_files import scan
from conductor.jobs import job_ledger, job_state
from conductor.redis_contract import keys as K
from conductor.redis_contract.config import ModelDefaults
from tests.conftest import ROOT, cli
from tests.helpers import contract, quick, results_for, wait_for
from tests.test_serve import jsonl, request

KEY = "sk-test-ledger"


class Serve:
    def __init__(self, url: str, base: str, data: Path) -> None:
        self.url, self.base, self.data = url, base, data
        self.client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        self.c = Conductor(connect(url))


@pytest.fixture(scope="module")
def serve(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """One serve for the module (each test makes batches of its own; nothing here flushes Redis)."""
    data = tmp_path_factory.mktemp("files")
    r = connect(redis_server.url)
    r.flushall()  # once, before serve: its batches live until the module ends
    p, base = start_serve(redis_server.url, data)
    try:
        yield Serve(redis_server.url, base, data)
    finally:
        p.terminate()
        assert p.wait(10) == 0


def start_serve(url: str, data: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    from tests.test_serve import served
    served(url)
    port = port or free_port()
    env = dict(os.environ, CONDUCTOR_REDIS_URL=url, CONDUCTOR_API_KEYS=KEY)
    p = subprocess.Popen([sys.executable, "-m", "conductor", "serve", "--port", str(port), "--data-dir", str(data)],
                         env=env, cwd=str(ROOT))
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _up(base) or p.poll() is not None, "serve did not start", timeout=60)
    assert p.poll() is None
    return p, base


def _up(base: str) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(base + "/", headers={"Authorization": f"Bearer {KEY}"}),
                               timeout=2).read()
        return True
    except OSError:
        return False


def _rows(tag: str, n: int) -> list[dict]:
    rows = [request(i) for i in range(n)]
    for r in rows:
        r["custom_id"] = f"{tag}-{r['custom_id']}"
    return rows


def _upload(s: Serve, rows: list[dict]) -> str:
    return s.client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch").id


def _lines(s: Serve, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in s.client.files.content(file_id).text.splitlines()]


def _run(s: Serve, n: int | None = None) -> int:
    """Claim and complete up to about ``n`` items of model m (all with None), as a worker would."""
    quick(s.c, "m")
    done = 0
    deadline = time.monotonic() + 30
    while n is None or done < n:
        b, why = s.c.claim(contract(size=4 if n else 64), "w")
        if b is None:
            if why == "idle":
                break
            assert time.monotonic() < deadline, why
            time.sleep(0.02)
            continue
        s.c.complete(b, results_for(b))
        done += len(b.items)
    return done


def _validating(s: Serve, rows: list[dict], sent: int, window_s: int | None = None) -> str:
    """A batch as a serve that died while it submitted leaves it: validating, its file declared,
    only its first ``sent`` lines in Redis, no thread of any serve at work on it."""
    file_id = _upload(s, rows)
    job = f"batch_{os.urandom(12).hex()}"
    job_state.start(s.c.r, job, status="validating", window_s=window_s, input_file_id=file_id,
                    endpoint="/v1/chat/completions")
    s.c.r.zadd(K.BATCHES_KEY, {job: int(time.time())})
    quick(s.c, "m")
    found = scan(str(s.data / f"{file_id}.jsonl"), default_max_tokens=ModelDefaults(lambda: s.c.r).max_tokens,
                 id_field="custom_id", parquet=False)
    prepare_job(s.c, found, job)
    first = next(found.chunks(sent))
    s.c.submit([it for _, it in first], job)
    return job


def _check_exact(s: Serve, batch_id: str, rows: list[dict], status: str, code: str) -> tuple[list, list]:
    """The batch ended ``status``: every custom_id once over its two files, the counts equal to the
    files and to the job ledger, and every unanswered line in the error file with ``code``."""
    b = s.client.batches.retrieve(batch_id)
    assert b.status == status, b
    out, err = _lines(s, b.output_file_id), _lines(s, b.error_file_id)
    assert sorted(x["custom_id"] for x in out + err) == sorted(r["custom_id"] for r in rows)
    assert {x["error"]["code"] for x in err} <= {code}
    rc = b.request_counts
    assert (rc.total, rc.completed, rc.failed) == (len(rows), len(out), len(err))
    led = job_ledger.build(s.c, batch_id, str(s.data / f"{b.input_file_id}.jsonl"))
    assert led.clean and led.request_counts() == {"total": rc.total, "completed": rc.completed, "failed": rc.failed}
    return out, err


def _follow(s: Serve, batch_id: str, until: set[str], timeout: float = 60):  # noqa: ANN202
    got = {}

    def ended() -> bool:
        got["b"] = s.client.batches.retrieve(batch_id)
        return got["b"].status in until
    wait_for(ended, f"batch {batch_id} did not reach {until}", timeout)
    return got["b"]


def test_cancel_and_expire_a_batch_left_validating_by_a_dead_serve(serve: Serve) -> None:
    rows = _rows("v", 30)
    job = _validating(serve, rows, 10)
    assert serve.client.batches.retrieve(job).status == "validating"
    assert _run(serve, 4) >= 4  # a worker answered some of what was sent
    c = serve.client.batches.cancel(job)
    assert c.status == "cancelled", c
    out, err = _check_exact(serve, job, rows, "cancelled", "cancelled")
    assert 4 <= len(out) <= 10 and len(err) == 30 - len(out)  # the 20 never sent are answered too
    # expiry acts on validating: a window of one second, no cancel
    rows = _rows("ve", 12)
    job = _validating(serve, rows, 5, window_s=1)
    _follow(serve, job, {"expired"}, timeout=30)  # the GET (or serve's expiry loop) ends it
    out, err = _check_exact(serve, job, rows, "expired", "expired")
    assert out == [] and len(err) == 12
    # nothing sent at all (serve died before the first chunk): still every line answered
    rows = _rows("v0", 6)
    job = _validating(serve, rows, 1)
    serve.c.r.delete(*[K.ModelKeys("m").job_intake(job)])  # as if the declaration was all that was left
    gone = serve.client.batches.cancel(job)
    assert gone.status == "cancelled" and gone.cancelled_at
    _check_exact(serve, job, rows, "cancelled", "cancelled")


def test_cancel_and_expire_in_progress_and_finalizing(serve: Serve) -> None:
    # in_progress, cancelled with part of it done
    rows = _rows("p", 20)
    b = serve.client.batches.create(input_file_id=_upload(serve, rows), endpoint="/v1/chat/completions",
                                    completion_window="24h")
    _follow(serve, b.id, {"in_progress"})
    _run(serve, 4)
    assert serve.client.batches.cancel(b.id).status == "cancelled"
    out, err = _check_exact(serve, b.id, rows, "cancelled", "cancelled")
    assert out and err
    # in_progress, expired by its window
    rows = _rows("pe", 8)
    b = serve.client.batches.create(input_file_id=_upload(serve, rows), endpoint="/v1/chat/completions",
                                    completion_window="2s")
    _follow(serve, b.id, {"expired"}, timeout=30)
    _check_exact(serve, b.id, rows, "expired", "expired")
    # finalizing recorded over a batch still running ends the same way (tests/test_finalize.py reaches
    # finalizing through the finalizer itself)
    rows = _rows("f", 6)
    b = serve.client.batches.create(input_file_id=_upload(serve, rows), endpoint="/v1/chat/completions",
                                    completion_window="24h")
    _follow(serve, b.id, {"in_progress"})
    serve.c.r.hset(K.job_meta_key(b.id), "status", "finalizing")
    assert serve.client.batches.retrieve(b.id).status == "finalizing"
    assert serve.client.batches.cancel(b.id).status == "cancelled"
    _check_exact(serve, b.id, rows, "cancelled", "cancelled")


def _post(s: Serve, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(s.base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_retry_after_cancel_covers_every_line_once(serve: Serve) -> None:
    rows = _rows("r", 24)
    job = _validating(serve, rows, 8)  # 16 lines never sent
    _run(serve, 4)
    serve.client.batches.cancel(job)
    old_out, old_err = _check_exact(serve, job, rows, "cancelled", "cancelled")
    v = cli("verify-job", job, "--data-dir", str(serve.data), url=serve.url)  # the batch's file, from serve's dir
    assert "24 input lines" in v.stdout.decode() and "16 never submitted" in v.stdout.decode(), v.stdout
    code, new = _post(serve, f"/v1/batches/{job}/retry", {})
    assert code == 200, new
    assert new["metadata"]["retry_of"] == job and new["id"] != job
    _follow(serve, new["id"], {"in_progress"})
    _run(serve)
    b = _follow(serve, new["id"], {"completed"})
    new_rows = [r for r in rows if r["custom_id"] in {x["custom_id"] for x in old_err}]
    new_out, new_err = _check_exact(serve, b.id, new_rows, "completed", "")
    ids = [x["custom_id"] for x in old_out + new_out + new_err]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # the union: every line once
    # nothing left to retry in a completed batch; a bad body names its field
    assert _post(serve, f"/v1/batches/{b.id}/retry", {})[0] == 409
    code, bad = _post(serve, f"/v1/batches/{job}/retry", {"only": ["done"]})
    assert code == 400 and bad["error"]["param"] == "only"


def test_cli_retry_after_expiry_and_verify_job(redis_url: str, tmp_path: Path) -> None:
    """A CLI job expired by its window, retried with conductor retry (the recorded input file; a line
    failed for input_too_long left out unless asked), checked by conductor verify-job, which also
    finds a doctored second answer."""
    c = Conductor(connect(redis_url))
    quick(c, "m")
    src = tmp_path / "in.jsonl"
    lines = [{"id": f"x{i}", "model": "m", "prompt": f"p{i}", "input_tokens": 30 if i < 4 else 10,
              "max_tokens": 4} for i in range(16)]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {"XDG_DATA_HOME": str(tmp_path / "data")}
    # a window the submit and the first batches fit in on a busy machine (with 1 s, a slow start
    # expired every line before the worker's first claim)
    cli("submit", "--create", str(src), "--job", "old", "--completion-window", "6s", "--tenant", "t1", "--priority",
        "background", url=redis_url, env=env)
    from tests.worker_kit import sim, worker
    # x0-x3 (a full batch of their own) are too long for it; at most one batch in flight at a time
    w = worker(c, sim(max_input_len=20), pending_ceiling=4)
    for _ in range(200):  # runs a part: x0-x3 fail input_too_long, a batch completes, 4 or more lines wait
        w.turn()
        st = c.status("old")
        if st["completed"] >= 1 and st["failed"] >= 1:
            break
    assert 0 < c.status("old")["pending"], c.status("old")
    ins = cli("inspect", "m", "--verify", url=redis_url, env=env)  # with the ledger of each job in flight
    assert "ledger: job old (in_progress): 16 input lines" in ins.stdout.decode(), ins.stdout.decode()
    wait_for(lambda: time.time() >= float(c.r.hget(K.job_meta_key("old"), "expires_at") or 0), "window", 20)
    cli("expire", url=redis_url, env=env)
    for _ in range(200):  # a batch in flight finishes and keeps its results; nothing else is claimed
        if job_state.describe(c, "old")["status"] == "expired":
            break
        w.turn()
    assert job_state.describe(c, "old")["status"] == "expired"
    v = cli("verify-job", "old", "--json", url=redis_url, env=env)
    led = json.loads(v.stdout)
    assert led["clean"] and led["inputs"] == 16 and led["codes"] == {"input_too_long": 4}
    done = led["answers"]["completed"]
    assert done + led["answers"]["expired"] + 4 == 16 and led["answers"]["expired"] >= 4
    r = cli("retry", "old", "--job", "new", url=redis_url, env=env)
    assert r.stdout.decode().strip() == "new" and "input_too_long" in r.stderr.decode()
    run_until = time.monotonic() + 30
    while not c.status("new")["done"]:
        w.turn()
        assert time.monotonic() < run_until
    old_ok = {x.id for x in c.read_results("old") if x.error is None}
    new_all = [x.id for x in c.read_results("new")]
    long = {"x0", "x1", "x2", "x3"}
    assert not long & set(new_all) and sorted(old_ok | set(new_all) | long) == sorted(x["id"] for x in lines)
    assert not old_ok & set(new_all)  # every line answered once over the two jobs
    meta = json.loads(c.r.hget(K.job_meta_key("new"), "metadata"))
    assert meta == {"retry_of": "old"}
    assert c.r.hmget(K.ModelKeys("m").job_intake("new"), "tenant", "prio") == [b"t1", b"background"]  # its class
    assert cli("verify-job", "new", url=redis_url, env=env, check=False).returncode == 0
    # --include-permanent retries x0 too; --only expired leaves the failed line out
    r = cli("retry", "old", "--job", "again", "--only", "failed", "--include-permanent", url=redis_url, env=env)
    assert c.status("again")["submitted"] == 4
    # a doctored second answer: verify-job exits 1 naming the id
    mk = K.ModelKeys("m")
    eid, fields = c.r.xrange(mk.job_results("new"), count=1)[0]
    c.r.xadd(mk.job_results("new"), {k: v for k, v in fields.items()})
    bad = cli("verify-job", "new", url=redis_url, env=env, check=False)
    assert bad.returncode == 1 and fields[b"id"].decode() in bad.stdout.decode()
    assert "twice" in bad.stdout.decode()


def test_refused_lines_are_answered_as_validation_in_the_cli_error_file(redis_url: str, tmp_path: Path) -> None:
    """A --skip-invalid submit: the refused lines (a bad field, a repeated id) are the ledger's
    'validation' answers and lines of the OpenAI error file, so output + error lines = input lines."""
    c = Conductor(connect(redis_url))
    quick(c, "m")
    rows = [{"id": f"s{i}", "model": "m", "prompt": f"p{i}", "input_tokens": 10, "max_tokens": 4} for i in range(8)]
    rows[2]["max_tokens"] = -1  # refused: a bad field
    rows.append(dict(rows[5]))  # refused: a repeated id
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in rows))
    cli("submit", "--create", str(src), "--job", "sk", "--skip-invalid", url=redis_url)
    while not c.status("sk")["done"]:
        b, why = c.claim(contract(), "w")
        if b is not None:
            c.complete(b, results_for(b))
    cli("results", "sk", "--format", "openai", "-o", str(tmp_path / "out.jsonl"), "--errors",
        str(tmp_path / "err.jsonl"), url=redis_url)
    out = (tmp_path / "out.jsonl").read_text().splitlines()
    err = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert len(out) == 7 and len(out) + len(err) == len(rows)
    assert [x["error"]["code"] for x in err] == ["validation", "validation"]
    assert "duplicate of line 6" in err[1]["error"]["message"]
    led = json.loads(cli("verify-job", "sk", "--json", url=redis_url).stdout)
    assert led["clean"] and led["answers"] == {"completed": 7, "validation": 2} and led["inputs"] == 9
    # the same file cancelled before it ran: each line once, refused ones 'validation', the rest 'cancelled'
    cli("submit", "--create", str(src), "--job", "sk2", "--skip-invalid", url=redis_url)
    cli("cancel", "sk2", url=redis_url)
    cli("results", "sk2", "--format", "openai", "-o", str(tmp_path / "out2.jsonl"), "--errors",
        str(tmp_path / "err2.jsonl"), url=redis_url)
    err = [json.loads(x) for x in (tmp_path / "err2.jsonl").read_text().splitlines()]
    assert (tmp_path / "out2.jsonl").read_text() == "" and len(err) == len(rows)
    assert sorted(x["error"]["code"] for x in err) == ["cancelled"] * 7 + ["validation"] * 2


def test_cancel_while_a_live_serve_submits_the_file(serve: Serve) -> None:
    """Cancelled while serve's thread still sends the file (chunks of 5,000): the thread stops at the
    next chunk, what it sent meanwhile is answered too, and every line is answered once."""
    rows = _rows("big", 6_000)
    b = serve.client.batches.create(input_file_id=_upload(serve, rows), endpoint="/v1/chat/completions",
                                    completion_window="24h")
    wait_for(lambda: serve.c.status(b.id)["submitted"] > 0, "nothing was sent", 60)
    c = serve.client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    _follow(serve, b.id, {"cancelled"})
    wait_for(lambda: serve.c.status(b.id)["pending"] == 0, "items sent after the cancel", 30)
    _check_exact(serve, b.id, rows, "cancelled", "cancelled")  # (here: 5,000 of 6,000 lines were sent)


def test_the_ledger_of_a_job_without_a_kept_input_reads_the_registry(cdr: Conductor) -> None:
    """No file kept (a library submit): the ids Redis holds are the input. An id compacted out of
    the registry is still one line; a result for an id nobody submitted is a phantom."""
    quick(cdr, "m")
    from tests.conftest import item
    cdr.submit([item(f"k{i}", 10) for i in range(5)], "lib")
    while not cdr.status("lib")["done"]:
        b, _why = cdr.claim(contract(), "w")
        if b is not None:
            cdr.complete(b, results_for(b))
    led = job_ledger.build(cdr, "lib", None)
    assert led.clean and led.inputs == 5 and led.kinds["completed"] == 5 and "registry" in led.source
    cdr.r.hdel(K.ModelKeys("m").job_sums("lib"), "k3")  # as a compaction of answered ids leaves it
    assert job_ledger.build(cdr, "lib", None).clean
    mk = K.ModelKeys("m")
    _eid, fields = cdr.r.xrange(mk.job_results("lib"), count=1)[0]
    cdr.r.xadd(mk.job_results("lib"), {b"id": b"zz", b"r": fields[b"r"].replace(fields[b"id"], b"zz")})
    led = job_ledger.build(cdr, "lib", None)
    assert not led.clean and led.phantom == ["zz"] and led.inputs == 5, led.render()
    eid, fields = cdr.r.xrange(mk.job_results("lib"), count=1)[0]  # a result lost: a line with no answer
    cdr.r.xdel(mk.job_results("lib"), eid)
    led = job_ledger.build(cdr, "lib", None)
    assert led.missing == [fields[b"id"].decode()] and "with no answer" in led.render()


def test_lines_an_intake_sends_after_the_expiry_are_answered_too(cdr: Conductor) -> None:
    """Expired while its intake still sends (declared 10, sent 4): the job reads expired at once,
    stays among the deadlines, and the next expiry sweep answers the 6 sent afterwards."""
    from tests.conftest import item
    quick(cdr, "m")
    its = [item(f"e{i}", 10) for i in range(10)]
    cdr.declare("late", {"m": 10})
    cdr.submit(its[:4], "late")
    job_state.start(cdr.r, "late", window_s=1)
    job_state.expire_due(cdr, now=time.time() + 2)
    assert job_state.describe(cdr, "late", now=time.time() + 2)["status"] == "expired"
    assert cdr.r.zscore(K.JOB_DEADLINES_KEY, "late") is not None  # 6 lines may still come
    cdr.submit(its[4:], "late")
    job_state.expire_due(cdr, now=time.time() + 2 + job_state.RESWEEP_S)
    d = job_state.describe(cdr, "late", now=time.time() + 2 + job_state.RESWEEP_S)
    assert d["status"] == "expired" and d["request_counts"] == {"total": 10, "completed": 0, "failed": 10}
    assert sorted(x.id for x in cdr.read_results("late")) == sorted(it.id for it in its)
    assert cdr.r.zscore(K.JOB_DEADLINES_KEY, "late") is None  # every line in: nothing more to look at


def test_status_and_jobs_count_input_lines_as_the_ledger_does(redis_url: str, tmp_path: Path) -> None:
    """A --skip-invalid submit of 12 lines (a bad field, two repeated ids) is 9 items: conductor status
    and conductor jobs show the 12 lines and how each was answered (refused 3), the same figures and
    request counts as conductor verify-job, while it runs and once cancelled; the items stay labelled."""
    c = Conductor(connect(redis_url))
    quick(c, "m")
    rows = [{"id": f"l{i}", "model": "m", "prompt": f"p{i}", "input_tokens": 10, "max_tokens": 4} for i in range(10)]
    rows[3]["max_tokens"] = -1  # refused: a bad field
    rows += [dict(rows[6]), dict(rows[7])]  # refused: repeated ids
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in rows))
    cli("submit", "--create", str(src), "--job", "lc", "--skip-invalid", url=redis_url)

    def agree() -> dict:
        st = json.loads(cli("status", "lc", "--json", url=redis_url).stdout)
        led = json.loads(cli("verify-job", "lc", "--json", url=redis_url, check=False).stdout)
        row = next(r for r in json.loads(cli("jobs", "--json", url=redis_url).stdout) if r["job"] == "lc")
        lines = st["lines"]
        assert lines is not None and lines == row["lines"], (st, row)
        assert lines["input"] == led["inputs"] == 12 and lines["refused"] == led["answers"].get("validation", 0) == 3
        for kind in ("completed", "failed", "cancelled", "expired", "pending"):
            assert lines[kind] == led["answers"].get(kind, 0), (kind, lines, led)
        assert st["request_counts"] == led["request_counts"], (st, led)
        assert st["submitted"] == row["submitted"] == 9  # the items in Redis, labelled so
        text = cli("status", "lc", url=redis_url).stdout.decode().splitlines()[0]
        assert f"lines 12: {lines['completed']} completed, {lines['failed']} failed" in text and \
            "items submitted 9" in text, text
        listed = next(ln.split() for ln in cli("jobs", url=redis_url).stdout.decode().splitlines()
                      if ln.startswith("lc "))
        assert listed[4] == "12" and listed[-5] == "9", listed  # lines ... items (then tenant, priority, deadline)
        return lines

    b, _why = c.claim(contract(size=3), "w")  # one batch completes, one fails, the rest wait
    assert b is not None
    c.complete(b, results_for(b))
    b, _why = c.claim(contract(size=2), "w")
    assert b is not None
    c.complete(b, results_for(b, error=True))
    lines = agree()
    assert (lines["completed"], lines["failed"], lines["pending"]) == (3, 2, 4)
    cli("cancel", "lc", url=redis_url)
    lines = agree()
    got = (lines["completed"], lines["failed"], lines["cancelled"], lines["refused"], lines["pending"])
    assert got == (3, 2, 4, 3, 0)
