"""Durable intake (issue 25): a batch's or a CLI submit's intake is a task in Redis with a cursor, so
killing the process that runs it (SIGKILL) at any point leaves work that another process resumes,
exactly once. Real serve, CLI and worker processes, a real redis-server, the official openai SDK.

The kills are deterministic: CONDUCTOR_TEST_PAUSE_AT makes the k-th intake of a process stop at
the k-th named point (conductor/intake/intake_task.py), record it in its task and wait to be killed;
CONDUCTOR_TEST_SEND_CHUNK makes chunks of a few lines, so a small file has a middle."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from openai import OpenAI

from conductor.client import Conductor
from conductor.embedded import free_port
from conductor.errors import ConductorError
from conductor.intake import intake_task as T
from conductor.redis_contract import keys as K
from tests.conftest import ROOT
from tests.test_serve import KEY, follow, get, jsonl, lines_of, request, served, stop, worker

LINES = 60
CHUNK = 25  # 3 chunks: 25, 25, 10


def start_serve(redis_url: str, data_dir: Path, **env: str) -> tuple[subprocess.Popen, str]:
    served(redis_url)
    port = free_port()
    full = {**os.environ, "CONDUCTOR_REDIS_URL": redis_url, "CONDUCTOR_API_KEYS": KEY,
            "CONDUCTOR_TEST_SEND_CHUNK": str(CHUNK), **env}
    p = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "serve", "--port", str(port),
                          "--data-dir", str(data_dir)], env=full, cwd=str(ROOT))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            get(base + "/", KEY)
            return p, base
        except OSError:
            assert p.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.1)


def wait_paused(r: redis.Redis, job: str, point: str, timeout: float = 30) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        task = {k.decode(): v.decode() for k, v in r.hgetall(K.intake_task_key(job)).items()}
        if task.get("test_paused_at") == point:
            return task
        assert time.monotonic() < deadline, f"intake of {job} never reached {point}: {task}"
        time.sleep(0.05)


def wait_ended(r: redis.Redis, job: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (task := T.read(r, job)) is None or task.state in T.OPEN:
        assert time.monotonic() < deadline, task
        time.sleep(0.1)


def kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)


def test_serve_killed_at_each_point_of_intake_resumes_every_batch_exactly_once(redis_url, tmp_path):
    """One serve runs five batches' intakes, each stopped at another point; it is killed (SIGKILL),
    a new serve resumes them all from their cursors, a worker runs them: every batch completes and
    every custom_id is once in its output file."""
    points = ["first_chunk", "unrecorded_chunk", "mid_file", "last_chunk", "state_change"]
    r = redis.Redis.from_url(redis_url)
    p, base = start_serve(redis_url, tmp_path / "files", CONDUCTOR_TEST_PAUSE_AT=",".join([*points, "mid_file"]))
    client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    batches, cursors = [], {}
    try:
        for k, point in enumerate(points):
            rows = [request(1000 * k + i) for i in range(LINES)]
            f = client.files.create(file=(f"in{k}.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
            b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            task = wait_paused(r, b.id, point)
            assert task["source"] == "api" and task["state"] in T.OPEN and task["file_id"] == f.id
            cursors[point] = int(task["line"])
            batches.append(b.id)
        # a sixth, stopped mid-file and cancelled there: the resumed intake sends nothing more
        rows = [request(9000 + i) for i in range(LINES)]
        f = client.files.create(file=("cancelled.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
        cancelled = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id
        wait_paused(r, cancelled, "mid_file")
        assert client.batches.cancel(cancelled).status in ("cancelling", "cancelled")
    finally:
        kill(p)
    # where each stopped: nothing recorded before the first chunk and while the first was unrecorded,
    # one chunk before the second, all of them after the last
    assert cursors == {"first_chunk": 0, "unrecorded_chunk": 0, "mid_file": CHUNK, "last_chunk": LINES,
                       "state_change": LINES}, cursors
    # the chunk sent but not recorded is in Redis: the resumed intake sends it again
    assert Conductor(r).status(batches[1])["submitted"] == CHUNK
    for job in batches:
        assert r.hget(K.job_meta_key(job), "status") == b"validating"

    p, base = start_serve(redis_url, tmp_path / "files")
    client = OpenAI(base_url=base + "/v1", api_key=KEY)
    w = worker(redis_url)
    try:
        for job in batches:  # each intake ended (a batch whose items were all in can complete before)
            wait_ended(r, job)
        done = [follow(client, job, {"completed", "failed", "cancelled", "expired"}, timeout=90) for job in batches]
        outputs = [lines_of(client, b.output_file_id) for b in done]
        wait_ended(r, cancelled)
        deadline = time.monotonic() + 30  # each line sent answered once (cancelled or run)
        while (c := client.batches.retrieve(cancelled)).request_counts.completed + c.request_counts.failed < CHUNK:
            assert time.monotonic() < deadline, c
            time.sleep(0.2)
    finally:
        stop(w)
        stop(p)
    for k, b in enumerate(done):
        assert b.status == "completed", (points[k], b)
        assert b.in_progress_at is None or b.created_at <= b.in_progress_at <= b.completed_at, (points[k], b)
        rc = b.request_counts
        assert (rc.total, rc.completed, rc.failed) == (LINES, LINES, 0), (points[k], rc)
        ids = Counter(line["custom_id"] for line in outputs[k])
        assert ids == Counter(f"req-{1000 * k + i}" for i in range(LINES)), points[k]
        assert b.error_file_id is None
        task = T.read(r, b.id)
        assert task is not None and task.state == "done" and task.line == LINES and task.sent == LINES
        assert not r.zscore(K.INTAKE_TASKS_KEY, b.id)  # off the resumers' index

    # the cancelled one: its intake stopped where it was, recorded with the reason (the lines never
    # sent are the cancel's to answer: issue 25's other part)
    assert c.status == "cancelled" and c.request_counts.total == LINES, c  # every line, the unsent ones failed
    task = T.read(r, cancelled)
    assert task is not None and (task.state, task.reason, task.line, task.sent) == ("stopped", "cancelled", CHUNK,
                                                                                    CHUNK)


def native(i: int) -> str:
    return json.dumps({"id": f"n-{i}", "model": "m", "prefix": ["be brief"], "prompt": f"question {i}",
                       "input_tokens": 8, "max_tokens": 4}) + "\n"


def test_cli_submit_killed_mid_file_is_resumed_by_a_workers_maintenance(redis_url, tmp_path):
    """conductor submit killed (SIGKILL) after its first chunk: the task stays in Redis with its cursor;
    a worker started later (its maintenance lease holder reads the same path) resumes it, and the job
    completes with every id once."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(native(i) for i in range(LINES)))
    r = redis.Redis.from_url(redis_url)
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url, CONDUCTOR_TEST_SEND_CHUNK=str(CHUNK),
               CONDUCTOR_TEST_PAUSE_AT="unrecorded_chunk")
    p = subprocess.Popen([sys.executable, "-m", "conductor", "submit", "--create", str(src), "--job", "cj"], env=env,
                         cwd=str(ROOT), stdout=subprocess.DEVNULL)
    try:
        task = wait_paused(r, "cj", "unrecorded_chunk")
    finally:
        kill(p)
    assert (task["source"], task["state"], task["line"], task["path"]) == ("cli", "sending", "0", str(src.resolve()))
    cdr = Conductor(r)
    assert cdr.status("cj")["submitted"] == CHUNK  # sent, not recorded: sent again on resume
    w = worker(redis_url)
    try:
        deadline = time.monotonic() + 60
        while (st := cdr.status("cj"))["completed"] < LINES:
            assert time.monotonic() < deadline and w.poll() is None, st
            time.sleep(0.2)
    finally:
        stop(w)
    assert (st["submitted"], st["completed"], st["pending"]) == (LINES, LINES, 0), st
    ids = Counter(json.loads(res)["id"] for res in cdr.results("cj"))
    assert ids == Counter(f"n-{i}" for i in range(LINES))
    wait_ended(r, "cj")  # its items can all be done before the task records its end
    done = T.read(r, "cj")
    assert done is not None and (done.state, done.line, done.sent) == ("done", LINES, LINES)


def _task_file(tmp_path: Path, n: int) -> Path:
    src = tmp_path / "f.jsonl"
    src.write_text("".join(native(i) for i in range(n)))
    return src


def test_intake_stops_at_an_expired_job_and_records_where(cdr, tmp_path, monkeypatch):
    """In process: the job expires between two chunks (job_state.end records ending=expired): the
    next chunk is not sent, the task ends stopped with the reason, its cursor at the last chunk in."""
    from conductor.intake import intake_run
    from conductor.intake.file_intake import check_file, prepare_job
    from conductor.jobs import job_state
    monkeypatch.setenv(T.CHUNK_ENV, str(CHUNK))
    src = _task_file(tmp_path, LINES)
    d = intake_run.Defaults(lambda: cdr.r, None)
    found = check_file(str(src), skip_invalid=False, rejects=None, default_max_tokens=d)
    prepare_job(cdr, found, "ej")
    size, mtime = T.file_identity(str(src))
    T.create(cdr, T.Task(job="ej", source="cli", path=str(src), state="sending", defaults={}, size=size,
                         mtime_ns=mtime), "me")
    job_state.start(cdr.r, "ej", window_s=3600)
    sent = []
    real = intake_run.send_chunk

    def send_then_expire(c, chunk, job, **kw):  # noqa: ANN001, ANN003, ANN202
        rep = real(c, chunk, job, **kw)
        sent.append(len(chunk))
        cdr.r.hset(K.job_meta_key(job), "ending", "expired")  # what job_state.end(c, job, 'expired') records
        return rep
    monkeypatch.setattr(intake_run, "send_chunk", send_then_expire)
    out = intake_run.run(cdr, "ej", "me", found, d)
    assert out.state == "stopped" and sent == [CHUNK]
    task = T.read(cdr.r, "ej")
    assert task is not None and (task.state, task.reason, task.line, task.sent) == ("stopped", "expired", CHUNK, CHUNK)
    assert cdr.status("ej")["submitted"] == CHUNK and not cdr.r.zscore(K.INTAKE_TASKS_KEY, "ej")


def test_a_lapsed_lease_goes_to_one_taker_and_the_old_holder_cannot_move_the_cursor(cdr, tmp_path):
    from conductor.redis_contract import script_calls as calls
    src = _task_file(tmp_path, 3)
    T.create(cdr, T.Task(job="lj", source="cli", path=str(src), state="sending"), "old")
    key = K.intake_task_key("lj")
    assert not calls.intake_lease(key, "new", T.LEASE_MS).run(cdr.scripts).held  # the old lease runs
    cdr.r.hset(key, "lease_ms", 1)  # as if the old holder died long ago
    assert calls.intake_lease(key, "new", T.LEASE_MS).run(cdr.scripts).held
    assert not calls.intake_lease(key, "third", T.LEASE_MS).run(cdr.scripts).held
    assert not calls.intake_cursor(key, "old", T.LEASE_MS, 2, 2).run(cdr.scripts)  # fenced off
    assert calls.intake_cursor(key, "new", T.LEASE_MS, 2, 2).run(cdr.scripts)
    assert calls.intake_cursor(key, "new", T.LEASE_MS, 1, 1).run(cdr.scripts)  # never moves back
    task = T.read(cdr.r, "lj")
    assert task is not None and (task.owner, task.line, task.sent) == ("new", 2, 2)
    assert calls.intake_cursor(key, "new", T.LEASE_MS, 3, 3, "done").run(cdr.scripts)
    assert calls.intake_lease(key, "new", T.LEASE_MS).run(cdr.scripts).state == "ended"  # never taken again
    assert not calls.intake_cursor(key, "new", T.LEASE_MS, 4, 4).run(cdr.scripts)


def test_a_file_changed_since_its_intake_began_is_not_resumed(cdr, tmp_path):
    from conductor.intake import intake_run
    src = _task_file(tmp_path, 3)
    size, mtime = T.file_identity(str(src))
    T.create(cdr, T.Task(job="cj2", source="cli", path=str(src), state="sending", defaults={}, size=size,
                         mtime_ns=mtime), "me")
    src.write_text("".join(native(i) for i in range(5)))
    with pytest.raises(ConductorError, match="changed since its intake began"):  # a CLI task's: raised once recorded
        intake_run.run(cdr, "cj2", "me")
    task = T.read(cdr.r, "cj2")
    assert task is not None and task.state == "failed" and "changed" in task.error
    assert cdr.status("cj2")["submitted"] == 0


@pytest.mark.slow
def test_serve_killed_at_random_moments_of_a_long_intake_still_submits_every_line_once(redis_url, tmp_path):
    """The long form: no pause hook, serve SIGKILLed three times during a 6,000-line intake in chunks
    of 50, each time just after its cursor passed a random line (so mid-chunk, mid-cursor-write,
    wherever it is then), restarted each time; then a worker runs it: the batch completes with
    every custom_id once."""
    import random
    n, rng = 6000, random.Random(25)
    r = redis.Redis.from_url(redis_url)
    p, base = start_serve(redis_url, tmp_path / "files", CONDUCTOR_TEST_SEND_CHUNK="50")
    client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    f = client.files.create(file=("big.jsonl", io.BytesIO(jsonl([request(i) for i in range(n)]))), purpose="batch")
    job = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
    lines_at_kill = []
    try:
        for at in sorted(rng.sample(range(1, n - 500), 3)):
            deadline = time.monotonic() + 60
            while int(r.hget(K.intake_task_key(job), "line") or 0) < at:  # then killed wherever it is
                assert time.monotonic() < deadline, "the intake did not move"
                time.sleep(0.002)
            kill(p)
            lines_at_kill.append(int(r.hget(K.intake_task_key(job), "line") or 0))
            p, base = start_serve(redis_url, tmp_path / "files", CONDUCTOR_TEST_SEND_CHUNK="50")
        client = OpenAI(base_url=base + "/v1", api_key=KEY)
        w = worker(redis_url)
        try:
            b = follow(client, job, {"completed", "failed", "cancelled", "expired"}, timeout=240)
            out = lines_of(client, b.output_file_id)
        finally:
            stop(w)
    finally:
        stop(p)
    assert b.status == "completed", (lines_at_kill, b)
    assert (b.request_counts.total, b.request_counts.completed) == (n, n)
    assert Counter(line["custom_id"] for line in out) == Counter(f"req-{i}" for i in range(n))
    wait_ended(r, job)
    task = T.read(r, job)
    assert task is not None and task.state == "done" and task.sent == n and task.line == n
    assert int(r.hget(K.intake_task_key(job), "takes") or 0) >= 2  # resumed by the later serves


def test_a_batch_cancelled_before_its_intake_declared_anything_gets_nothing_written(cdr, tmp_path):
    """An API task resumed after its batch was cancelled (while no replica ran it) stops before the
    declaration: no item, no declared count, the task stopped with the reason."""
    from conductor.intake import intake_run
    from conductor.jobs import job_state
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([request(i) for i in range(5)]))
    cdr.r.sadd(K.MODELS_KEY, "m")  # a model this Redis knows (a batch for an unknown one fails validation)
    T.create(cdr, T.Task(job="batch_x", source="api", path=str(src), file_id="file-x", endpoint="/v1/chat/completions"),
             "me")
    job_state.start(cdr.r, "batch_x", status="validating")
    job_state.set_status(cdr.r, "batch_x", "cancelling", ending="cancelled")  # what POST .../cancel records
    assert intake_run.run(cdr, "batch_x", "me").state == "stopped"
    task = T.read(cdr.r, "batch_x")
    assert task is not None and (task.state, task.reason, task.sent) == ("stopped", "cancelled", 0)
    assert not cdr.job_models("batch_x") and not list(cdr.r.scan_iter(match="cdr:{*"))  # nothing declared


def test_a_task_whose_file_nobody_can_read_fails_after_its_deadline_naming_the_path(redis_url, tmp_path):
    """serve killed (SIGKILL) with a batch declared and nothing sent; its file is then removed. A
    restarted serve (deadline CONDUCTOR_INTAKE_UNREADABLE_S=3) cannot read it: once the task's
    lease has lapsed that long, the task ends failed with the path and the batch fails with an
    error naming it."""
    r = redis.Redis.from_url(redis_url)
    data = tmp_path / "files"
    p, base = start_serve(redis_url, data, CONDUCTOR_TEST_PAUSE_AT="first_chunk")
    client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    try:
        f = client.files.create(file=("gone.jsonl", io.BytesIO(jsonl([request(i) for i in range(LINES)]))),
                                purpose="batch")
        job = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
        wait_paused(r, job, "first_chunk")
    finally:
        kill(p)
    path = data / f"{f.id}.jsonl"
    path.unlink()
    p, base = start_serve(redis_url, data, CONDUCTOR_INTAKE_UNREADABLE_S="3")
    client = OpenAI(base_url=base + "/v1", api_key=KEY)
    try:
        b = follow(client, job, {"failed", "completed", "cancelled", "expired"}, timeout=90)
    finally:
        stop(p)
    assert b.status == "failed" and b.failed_at, b
    assert b.errors is not None and b.errors.data is not None
    err = b.errors.data[0]
    assert err.code == "input_unreadable" and str(path.resolve()) in (err.message or "") and \
        err.param == "input_file_id", err
    assert f"of {LINES} input line(s)" in (err.message or "") and "none of its lines" in (err.message or "")
    task = T.read(r, job)
    assert task is not None and task.state == "failed" and str(path.resolve()) in task.error
    assert not r.zscore(K.INTAKE_TASKS_KEY, job)


class _Alive:
    """A running task's thread, as a busy Resumer holds it."""

    def is_alive(self) -> bool:
        return True


def test_an_unreadable_task_is_failed_only_once_nobody_holds_it_for_the_deadline(cdr, tmp_path, monkeypatch):
    """Conservative: a live holder's task (its lease running) is never failed, however unreadable its
    file here; a lapsed one only after the deadline; a bad deadline setting is refused naming it."""
    from conductor.intake import intake_resume
    from conductor.jobs import job_state
    missing = str(tmp_path / "nowhere.jsonl")
    T.create(cdr, T.Task(job="uj", source="cli", path=missing, state="sending"), "live")
    job_state.start(cdr.r, "uj")
    res = intake_resume.Resumer(cdr, "resumer", unreadable_after_s=0)
    res.tick()
    task = T.read(cdr.r, "uj")
    assert task is not None and (task.state, task.owner) == ("sending", "live")  # held: left alone
    cdr.r.hset(K.intake_task_key("uj"), "lease_ms", T.server_ms(cdr.r) - 1000)  # lapsed a second ago
    intake_resume.Resumer(cdr, "resumer", unreadable_after_s=600).tick()
    task = T.read(cdr.r, "uj")
    assert task is not None and task.state == "sending"  # not yet past the deadline
    # a resumer that can read the file but runs its MAX_RUNNING tasks already stamps it readable:
    # not failed by the one that cannot read it (tests/test_durable_intake's resumers share one host,
    # so the readable one is shown by a file that exists for it)
    readable = tmp_path / "there.jsonl"
    readable.write_text("")
    cdr.r.hset(K.intake_task_key("uj"), "path", str(readable))
    busy = intake_resume.Resumer(cdr, "busy")
    busy._running = {f"other{i}": _Alive() for i in range(intake_resume.MAX_RUNNING)}
    busy.tick()
    assert cdr.r.hget(K.intake_task_key("uj"), "readable_ms") is not None
    cdr.r.hset(K.intake_task_key("uj"), "path", missing)
    res.unreadable_ms = 60_000  # read as readable a moment ago: within the deadline
    res.tick()
    task = T.read(cdr.r, "uj")
    assert task is not None and task.state == "sending"
    res.unreadable_ms = 0
    res.tick()
    task = T.read(cdr.r, "uj")
    assert task is not None and task.state == "failed" and missing in task.error
    meta = cdr.r.hgetall(K.job_meta_key("uj"))
    assert meta[b"status"] == b"failed" and b"input_unreadable" in meta[b"errors"]
    assert missing.encode() in meta[b"errors"]
    monkeypatch.setenv(intake_resume.UNREADABLE_ENV, "soon")
    with pytest.raises(ConductorError, match=intake_resume.UNREADABLE_ENV):
        intake_resume.Resumer(cdr, "x")


def test_a_fresh_intake_task_is_born_leased_so_a_racing_resumer_never_takes_it(cdr, redis_url, tmp_path, monkeypatch):
    # Issue 37: a task recorded and then leased by a second call was, in between, an open task with no
    # live lease; a worker's resumer took it from the submit still running it ("its intake task was
    # taken by another process"). Here a resumer sweeps without pause while 300 fresh intakes begin.
    import threading

    from conductor.intake.intake_resume import Resumer
    src = tmp_path / "in.jsonl"
    src.write_text("")
    taken: list[str] = []
    monkeypatch.setattr(Resumer, "_run", lambda self, job: taken.append(job))
    own = redis.Redis.from_url(redis_url)
    resumer = Resumer(Conductor(own), "resumer")
    stop_sweeping = threading.Event()

    def sweep() -> None:
        while not stop_sweeping.is_set():
            resumer.tick()
    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    refused: list[str] = []
    try:
        for i in range(300):
            try:
                T.create(cdr, T.Task(job=f"j{i}", source="cli", path=str(src), state="sending", defaults={}),
                         "creator")
            except ConductorError as e:
                refused.append(str(e))
            task = T.read(cdr.r, f"j{i}")
            assert task is not None and task.owner == "creator" and task.lease_ms > 0
            cdr.r.hset(K.intake_task_key(f"j{i}"), "state", "done")  # ended: the sweep drops it from the index
    finally:
        stop_sweeping.set()
        sweeper.join(30)
        own.close()
    assert refused == [] and taken == []
    # a live holder's task is not replaced; an ended one is, with a fresh lease
    cdr.r.hset(K.intake_task_key("j0"), mapping={"state": "sending", "lease_ms": T.server_ms(cdr.r) + 60_000})
    with pytest.raises(ConductorError, match="being submitted by another process \\(creator\\)"):
        T.create(cdr, T.Task(job="j0", source="cli", path=str(src), state="sending", defaults={}), "second")
    T.create(cdr, T.Task(job="j1", source="cli", path=str(src), state="sending", defaults={}), "second")
    assert T.read(cdr.r, "j1").owner == "second"
