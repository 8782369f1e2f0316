"""Progress as a user sees it: one live line (done/total, rate, ETA) on a terminal (a real pty),
plain lines in a pipe; a hint when no live worker serves a job being followed or watched; the
summary ``conductor run`` ends with."""

import json
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time

from conductor.redis_contract.records import Contract
from tests.conftest import ROOT, cli, item
from tests.helpers import drain, quick

C = Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096)
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def on_pty(argv: list[str], url: str, timeout: float = 120, env: dict | None = None,
           typed: bytes | None = None, wrote: threading.Event | None = None) -> tuple[int, bytes]:
    """Run ``conductor argv`` with stdout and stderr on a pseudo-terminal; (exit status, what it wrote).
    ``typed``: the terminal is its stdin too, and this is what the user types. ``wrote``: set once it
    wrote something."""
    master, slave = pty.openpty()
    stdin = subprocess.DEVNULL if typed is None else slave
    p = subprocess.Popen([sys.executable, "-m", "conductor", *argv], stdin=stdin, stdout=slave,
                         stderr=slave, cwd=str(ROOT), env=dict(os.environ, CONDUCTOR_REDIS_URL=url, COLUMNS="160",
                                                              **(env or {})))
    os.close(slave)
    if typed is not None:
        os.write(master, typed)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
                if wrote is not None:
                    wrote.set()
            elif p.poll() is not None:
                break
        return p.wait(timeout=max(1.0, deadline - time.monotonic())), out
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
            p.wait()


def jsonl(path, n, model="m"):
    path.write_text("".join(json.dumps({"id": f"i{k}", "model": model, "prompt": "hi " * (k % 7 + 1),
                                        "prefix": ["You are terse and exact."], "max_tokens": 4}) + "\n"
                            for k in range(n)))
    return str(path)


def test_run_shows_a_live_line_on_a_terminal_and_ends_with_a_summary(redis_url, tmp_path):
    src = jsonl(tmp_path / "in.jsonl", 400)
    code, out = on_pty(["run", src, "--workers", "2", "-o", str(tmp_path / "out.jsonl"), "--job", "live"], redis_url)
    assert code == 0, out.decode(errors="replace")
    assert ANSI.search(out)  # drawn in place, not scrolled
    text = ANSI.sub(b"", out).decode()
    assert re.search(r"400/400 results · [\d.,]+/s · ETA 0:00:00", text), text
    summary = re.search(r"job live: ([\d,]+) batches, ([\d.]+) items per batch \(mean\), padding ([\d.]+)% of "
                        r"dispatched tokens, prefix hits ([\d,]+) tokens", text)
    assert summary, text
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    batches = {r["batch"] for r in rows}
    assert int(summary.group(1)) == len(batches) and float(summary.group(2)) == round(400 / len(batches), 1)
    assert int(summary.group(4).replace(",", "")) > 0  # one shape: every batch after the first hits the cache
    # the fleet's balance, from each worker's busy seconds (issue 24)
    fleet = re.search(r"2 workers busy ([\d.]+) to ([\d.]+) s \(max/mean ([\d.]+)\)", text)
    assert fleet, text
    lo, hi, ratio = map(float, fleet.groups())
    assert lo <= hi and 1.0 <= ratio <= 2.0


def test_run_in_a_pipe_writes_plain_progress_lines(redis_url, tmp_path):
    src = jsonl(tmp_path / "in.jsonl", 200)
    p = cli("run", src, "--workers", "1", "-o", str(tmp_path / "out.jsonl"), "--job", "piped", url=redis_url,
            env={"CONDUCTOR_PROGRESS_S": "0"})
    err = p.stderr.decode()
    assert not ANSI.search(p.stderr)
    assert re.search(r"^job piped: \d+/200 results, [\d.,-]+/s, ETA [\d:-]+", err, re.M), err
    assert re.search(r"^job piped: [\d,]+ batches, [\d.]+ items per batch", err, re.M), err


def test_submit_of_a_large_file_shows_its_line(redis_url, tmp_path):
    src = jsonl(tmp_path / "big.jsonl", 12_000)
    code, out = on_pty(["submit", "--create", src, "--job", "big"], redis_url)
    text = ANSI.sub(b"", out).decode()
    assert code == 0 and re.search(r"submit big .*12000/12000 items · [\d.,]+/s · ETA 0:00:00", text), text
    p = cli("submit", "--create", src, "--job", "big", "--resume", url=redis_url,
            env={"CONDUCTOR_PROGRESS_S": "0"})
    assert re.search(rb"^submit big: \d+/12000 items, ", p.stderr, re.M) and not ANSI.search(p.stderr)
    assert b"submitted 0 items (12000 already there)" in p.stderr


def _finish_slowly(cdr, batches_apart_s=0.3, start: threading.Event | None = None):
    """Complete the job a batch at a time, after ``start`` is set (the watcher printed its first
    line: on a loaded machine its start-up alone can take longer than the whole job) or a second."""
    def go():
        if start is None:
            time.sleep(1.0)
        else:
            start.wait(60)
        while True:
            b, why = cdr.claim(C, "w")
            if b is None:
                if why == "idle":
                    return
                time.sleep(0.05)
                continue
            from tests.helpers import results_for
            cdr.complete(b, results_for(b))
            time.sleep(batches_apart_s)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_status_watch_is_one_live_line_with_rate_and_eta(redis_url, cdr):
    from conductor.client import Conductor, connect
    quick(cdr)
    cdr.submit([item(f"i{k}", 10) for k in range(64)], "w")
    started = threading.Event()
    t = _finish_slowly(Conductor(connect(redis_url)), start=started)
    code, out = on_pty(["status", "w", "--watch", "--interval", "0.2"], redis_url, timeout=60, wrote=started)
    t.join(30)
    text = ANSI.sub(b"", out).decode()
    assert code == 0, text
    assert re.search(r"job w .*\d+/64 answered · [\d.,]+/s · ETA \d+:\d\d:\d\d · 0 failed", text), text
    assert text.rstrip().endswith("job w: submitted 64, completed 64, failed 0, pending 0")


def test_status_watch_in_a_pipe_adds_rate_and_eta_to_its_lines(redis_url, cdr):
    from conductor.client import Conductor, connect
    quick(cdr)
    cdr.submit([item(f"i{k}", 10) for k in range(64)], "w")
    started = threading.Event()
    t = _finish_slowly(Conductor(connect(redis_url)), start=started)
    lines = []
    with subprocess.Popen([sys.executable, "-m", "conductor", "status", "w", "--watch", "--interval", "0.2"],
                          env=dict(os.environ, CONDUCTOR_REDIS_URL=redis_url), cwd=str(ROOT),
                          stdout=subprocess.PIPE) as p:
        assert p.stdout is not None
        for raw in p.stdout:  # each line is flushed as it is written
            lines.append(raw.decode().rstrip("\n"))
            started.set()
        assert p.wait(60) == 0
    t.join(30)
    assert any(re.fullmatch(r"job w: submitted 64, completed \d+, failed 0, pending \d+, [\d.,]+/s, ETA [\d:]+", ln)
               for ln in lines), lines
    assert lines[-1] == "job w: submitted 64, completed 64, failed 0, pending 0"


def _read_until(stream, needle: bytes, timeout: float = 30) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while needle not in got and time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        got += line
    return got


def test_follow_and_watch_hint_when_no_live_worker_serves_a_model(redis_url, cdr):
    quick(cdr)
    quick(cdr, "other")
    cdr.submit([item("a", 10), item("b", 10, model="other")], "j")
    # a live worker of m (registered, heartbeat fresh); none of 'other'
    cdr.r.hset("cdr:{m}:workers", "w-m", "{}")
    cdr.r.set("cdr:{m}:hb:w-m", 1, px=60_000)
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url)
    for argv in (["results", "j", "--follow"], ["status", "j", "--watch", "--interval", "0.2"]):
        p = subprocess.Popen([sys.executable, "-m", "conductor", *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=env, cwd=str(ROOT))
        try:
            err = _read_until(p.stderr, b"hint")
            assert b"conductor: hint: no live worker serves model other;" in err, err
            assert b"model m" not in err
        finally:
            p.kill()
            p.wait()
            p.stderr.close()
    drain(cdr, C)
    drain(cdr, Contract(model="other", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096))
    p = cli("results", "j", "--follow", url=redis_url, timeout=30)
    assert b"hint" not in p.stderr  # a finished job needs no worker
