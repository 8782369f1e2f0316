"""Issue 37, what a newcomer met, each finding tried again through the real ``conductor`` command as
a subprocess against a real redis-server: an interrupted run keeps an earlier output and prints a
resume command that runs as printed, a Redis URL that never answers, unknown models, a job's
class, one vocabulary for answers, and the smaller points."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, cli


def lines(path: Path, count: int, model: str = "m", start: int = 0) -> Path:
    path.write_text("".join(json.dumps({"id": f"i{k}", "model": model, "prefix": [f"system {k % 3}"],
                                        "prompt": "p", "input_tokens": 20, "max_tokens": 16}) + "\n"
                            for k in range(start, start + count)))
    return path


def no_url_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CONDUCTOR_REDIS_URL"}


# ---------------------------------------------------------------- an interrupted run (findings 3 and 7)

BIG = 120  # batches of 16: a SIGINT after the first result leaves most of them not done


def test_a_stopped_run_keeps_the_earlier_output_and_its_resume_hint_runs_as_printed(redis_url, tmp_path):
    small = lines(tmp_path / "c.jsonl", 40)
    out = tmp_path / "full.jsonl"
    cli("run", str(small), "--job", "first", "-o", str(out), url=redis_url)
    earlier = out.read_bytes()
    assert len(earlier.splitlines()) == 40

    big = lines(tmp_path / "big.jsonl", BIG)
    env = dict(no_url_env(), CONDUCTOR_PROGRESS_S="0")
    p = subprocess.Popen([sys.executable, "-m", "conductor", "run", str(big), "--job", "big", "--workers", "1",
                          "--max-batch-size", "16", "--sim-time-scale", "5", "-o", str(out), "--redis", redis_url],
                         cwd=str(ROOT), stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        assert p.stderr is not None
        deadline = time.monotonic() + 120
        while True:
            line = p.stderr.readline()
            assert line and time.monotonic() < deadline, "the run did not get going"
            if (m := re.search(rb": (\d+)/%d results" % BIG, line)) and int(m.group(1)) > 0:
                break
        os.killpg(p.pid, signal.SIGINT)
        assert p.wait(60) == 130
        err = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stderr is not None:
            p.stderr.close()
    assert out.read_bytes() == earlier  # the earlier complete output, as it was
    part = tmp_path / "full.partial.jsonl"
    stop_line = err.strip().splitlines()[-1]
    m = re.search(rf"stopped by SIGINT: (\d+) results written to {re.escape(str(part))} "
                  rf"\({re.escape(str(out))} kept as it was\), (\d+) of {BIG} items not done; to finish it: (.*)$",
                  stop_line)
    assert m, err
    assert int(m.group(1)) == len(part.read_text().splitlines()) > 0
    hint = m.group(3)
    assert f"-o {out}" in hint and f"--redis {redis_url}" in hint and hint.endswith("--job big --resume")

    # pasted as printed (no CONDUCTOR_REDIS_URL: the hint carries its Redis), it finishes the job
    done = subprocess.run(shlex.split(hint), cwd=str(ROOT), capture_output=True, env=no_url_env(), timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"i{k}" for k in range(BIG))


# ---------------------------------------------------------------- a port that is not Redis (finding 4)

def _silent_port(answer: bytes | None) -> tuple[int, object]:
    """A listening port that accepts and never answers (``answer`` None) or answers ``answer`` to anything."""
    import socket
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                conn.recv(1024)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()

    def close() -> None:
        srv.close()
        for c in held:
            c.close()
    return srv.getsockname()[1], close


def test_a_port_that_accepts_and_never_answers_is_one_line_and_exit_2_within_seconds():
    for answer, expect in ((None, "did not answer within 5 s: it accepted the connection and sent nothing"),
                           (b"HTTP/1.1 400 Bad Request\r\n\r\n", "answered, but not as Redis does")):
        port, close = _silent_port(answer)
        try:
            t0 = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "conductor", "--redis", f"redis://127.0.0.1:{port}/0", "jobs"],
                               capture_output=True, env=no_url_env(), cwd=str(ROOT), timeout=120)
            took = time.monotonic() - t0
        finally:
            close()  # type: ignore[operator]
        err = p.stderr.decode().strip().splitlines()
        assert p.returncode == 2 and len(err) == 1 and err[0].startswith("conductor: ") and expect in err[0], err
        assert took < 60, took  # the old client waited out every retry's timeout: minutes


# ---------------------------------------------------------------- a model name with a typo (finding 5)

def test_a_typo_in_a_model_is_refused_at_submit_with_a_did_you_mean_and_never_becomes_a_model(redis_url, cdr,
                                                                                               tmp_path):
    from conductor.redis_contract import keys as K
    cdr.ensure_model("demo-7b")  # a worker of demo-7b registered
    src = tmp_path / "typo.jsonl"
    src.write_text("".join(json.dumps({"id": f"i{k}", "model": "demo-7bb" if k == 2 else "demo-7b", "prompt": "p",
                                       "max_tokens": 4}) + "\n" for k in range(5)))
    p = cli("submit", str(src), "--job", "t", url=redis_url, check=False)
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert "line 3: model: 'demo-7bb' is unknown to this Redis; did you mean 'demo-7b'? (known: demo-7b; " \
           "--create makes it)" in err
    assert cdr.models() == ["demo-7b"] and not cdr.r.zscore(K.JOBS_KEY, "t")  # nothing written
    # inspect never offers the refused name
    p = cli("inspect", "demo-7bbb", url=redis_url, check=False)
    assert p.returncode == 2 and "'demo-7bb'" not in p.stderr.decode() and "'demo-7b'" in p.stderr.decode()
    # --skip-invalid submits the other lines (the refused one in the rejects), still no new model
    cli("submit", str(src), "--job", "t", "--skip-invalid", url=redis_url)
    assert cdr.models() == ["demo-7b"] and cdr.status("t")["submitted"] == 4
    # --create says the model is new (its workers start later): then it is made
    cli("submit", str(src), "--job", "t2", "--create", url=redis_url)
    assert cdr.models() == ["demo-7b", "demo-7bb"]


def test_a_batch_api_line_for_an_unserved_model_fails_validation_naming_the_line(redis_url, cdr, tmp_path):
    from openai import OpenAI

    from tests.test_durable_intake import start_serve
    from tests.test_serve import KEY, follow, jsonl, request
    cdr.ensure_model("m")
    serve, base = start_serve(redis_url, tmp_path / "files")
    try:
        client = OpenAI(base_url=base + "/v1", api_key=KEY)
        rows = [request(i) for i in range(4)]
        rows[2]["body"]["model"] = "mm"
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = follow(client, b.id, {"failed", "in_progress", "completed"})
    finally:
        serve.terminate()
        assert serve.wait(30) == 0
    assert b.status == "failed"
    (e,) = b.errors.data
    assert (e.code, e.line, e.param) == ("model_not_found", 3, "body.model")
    assert "'mm' is not served here; did you mean 'm'? (served: m)" in e.message
    assert cdr.models() == ["m"]


# ---------------------------------------------------------------- a job's class (finding 6)

def test_a_jobs_class_is_shown_and_one_past_its_deadline_is_reported(redis_url, tmp_path):
    from tests.helpers import wait_for
    src = lines(tmp_path / "a.jsonl", 5)
    cli("submit", str(src), "--create", "--job", "a", "--tenant", "team-a", "--priority", "background",
        "--deadline", "2h", url=redis_url)
    cli("submit", str(src), "--job", "own", url=redis_url)
    cli("submit", str(src), "--job", "soon", "--deadline", "3s", url=redis_url)
    table = cli("jobs", url=redis_url).stdout.decode().splitlines()
    assert table[0].split()[-5:] == ["items", "tenant", "priority", "deadline", "state"]
    row = next(x for x in table if x.startswith("a "))
    assert " team-a " in row and " background " in row and row.endswith("in_progress")
    own = next(x for x in table if x.startswith("own "))
    assert own.split()[-4:] == ["-", "batch", "-", "in_progress"]
    rows = {r["job"]: r for r in json.loads(cli("jobs", "--json", url=redis_url).stdout)}
    assert (rows["a"]["tenant"], rows["a"]["priority"], rows["a"]["past_deadline"]) == ("team-a", "background", False)
    assert abs(rows["a"]["deadline_ms"] / 1000 - time.time() - 7200) < 120 and rows["a"]["deadline"].endswith("Z")
    assert (rows["own"]["tenant"], rows["own"]["deadline"]) == (None, None)
    first = cli("status", "a", url=redis_url).stdout.decode().splitlines()[0]
    assert "tenant team-a, priority background, deadline " in first and "(in 2h)" in first

    # three seconds on, job soon is past its deadline: jobs and status say so
    wait_for(lambda: json.loads(cli("jobs", "--json", url=redis_url).stdout)[-1]["past_deadline"], "past it",
             timeout=60)
    soon = next(x for x in cli("jobs", url=redis_url).stdout.decode().splitlines() if x.startswith("soon "))
    assert soon.endswith("in_progress, past its deadline")
    assert "(past it by " in cli("status", "soon", url=redis_url).stdout.decode().splitlines()[0]
    st = json.loads(cli("status", "soon", "--json", url=redis_url).stdout)
    assert st["past_deadline"] is True and st["tenant"] is None and st["priority"] == "batch"


def test_a_deadline_already_past_is_refused_for_a_new_job(redis_url, cdr, tmp_path):
    from conductor.redis_contract import keys as K
    src = lines(tmp_path / "a.jsonl", 5)
    p = cli("submit", str(src), "--create", "--job", "late", "--deadline", "2020-01-01T00:00:00Z", url=redis_url,
            check=False)
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("conductor: --deadline: 2020-01-01T00:00:00Z is ") and "in the past" in err[0]
    assert cdr.r.zscore(K.JOBS_KEY, "late") is None and cdr.models() == []


# ---------------------------------------------------------------- one vocabulary (finding 8)

def test_status_says_cancelled_in_every_line_and_watch_on_a_cancelled_job_exits_0(redis_url, cdr, tmp_path):
    from tests.conftest import item
    src = lines(tmp_path / "a.jsonl", 30)
    cli("submit", str(src), "--create", "--job", "c", url=redis_url)
    cdr.submit([item(i, 10) for i in range(20)], "lib")  # a library submit: no input lines known
    for job in ("c", "lib"):
        cli("cancel", job, url=redis_url)
    text = cli("status", "c", url=redis_url).stdout.decode().splitlines()
    assert "lines 30: 0 completed, 0 failed, 30 cancelled, 0 expired, 0 refused, 0 pending" in text[0]
    assert text[1] == "job c: submitted 30, completed 0, failed 0, cancelled 30, pending 0"
    text = cli("status", "lib", url=redis_url).stdout.decode().splitlines()
    assert "items 20: 0 completed, 0 failed, 20 cancelled, 0 expired, 0 pending" in text[0]
    assert text[1] == "job lib: submitted 20, completed 0, failed 0, cancelled 20, pending 0"
    st = json.loads(cli("status", "c", "--json", url=redis_url).stdout)
    assert (st["failed"], st["cancelled"], st["request_counts"]["failed"]) == (0, 30, 30)  # OpenAI's counts
    row = next(r for r in json.loads(cli("jobs", "--json", url=redis_url).stdout) if r["job"] == "c")
    assert (row["failed"], row["cancelled"]) == (0, 30)
    for job in ("c", "lib"):
        p = cli("status", job, "--watch", url=redis_url, check=False)
        assert p.returncode == 0, p.stdout.decode()


# ---------------------------------------------------------------- the smaller points (finding 11)

def test_a_bad_line_is_said_with_one_prefix_and_help_has_no_markup_or_empty_defaults(redis_url, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n" + '{"id": "b"}\n')
    p = cli("submit", str(src), "--create", url=redis_url, check=False)
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 2 and len(err) == 2 and all(x.startswith("conductor: ") for x in err), err
    assert err[0].startswith("conductor: line 2: ")
    for argv in ([], ["submit"], ["run"], ["serve"], ["jobs"], ["status"]):
        text = cli(*argv, "--help", url=redis_url).stdout.decode()
        assert "``" not in text and "(default: )" not in text and "(default: [])" not in text, argv
    assert "tenant" in cli("jobs", "--help", url=redis_url).stdout.decode()  # the help says what it shows
    assert "cancelled" in cli("status", "--help", url=redis_url).stdout.decode()
    retry_help = " ".join(cli("retry", "--help", url=redis_url).stdout.decode().split())
    assert "conductor/files/retries/NEW.jsonl" in retry_help  # where it keeps a retry's input, said up front


def test_a_mistyped_command_gets_a_did_you_mean(redis_url):
    p = cli("sumbit", "x.jsonl", url=redis_url, check=False)
    err = p.stderr.decode().strip()
    assert p.returncode == 2 and err == ("conductor: argument COMMAND: invalid choice: 'sumbit'; did you mean "
                                         "'submit'? (see conductor --help)")


def test_tenants_show_the_jobs_without_a_tenant_as_one_row_and_an_empty_tenant_is_refused(redis_url, tmp_path):
    src = lines(tmp_path / "a.jsonl", 3)
    cli("submit", str(src), "--create", "--job", "team-job", "--tenant", "team-a", url=redis_url)
    for k in range(3):
        cli("submit", str(src), "--job", f"own-{k}", url=redis_url)
    rows = json.loads(cli("tenants", "--json", url=redis_url).stdout)
    assert [(r["tenant"], r["own"], r["waiting_items"]) for r in rows] == [("team-a", False, 3), (None, True, 9)]
    text = cli("tenants", url=redis_url).stdout.decode().splitlines()
    assert [ln.split()[0] for ln in text[1:]] == ["team-a", "-"] and "(no tenant)" in text[2]
    for argv in (["tenant", ""], ["tenant", "", "--weight", "2"]):
        p = cli(*argv, url=redis_url, check=False)
        assert p.returncode == 2 and p.stderr.decode().startswith("conductor: tenant: a name is needed"), argv
