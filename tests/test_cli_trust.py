"""Issue 29, "a CLI a newcomer can trust", each finding tried again through the real ``conductor``
command as a subprocess: no stale answers from a rerun, no lost input, no orphans after a signal,
request options carried or refused, one status for a job, write errors in one line, typos refused."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
from tests.conftest import ROOT, cli, item
from tests.helpers import drain, quick
from tests.test_cli_basics import one_line_error


def openai_lines(path: Path, count: int, model: str = "m", **body: object) -> str:
    path.write_text("".join(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": model, "max_tokens": 8, **body, "messages": [
                                            {"role": "system", "content": "be brief"},
                                            {"role": "user", "content": f"question {k}"}]}}) + "\n"
                            for k in range(count)))
    return str(path)


def refusal(p: subprocess.CompletedProcess) -> str:
    """A run's refusal: exit 2, no traceback, the reason on its last line (after where its Redis is)."""
    err = p.stderr.decode()
    assert p.returncode == 2 and "Traceback" not in err, (p.returncode, err)
    return err.strip().splitlines()[-1]


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()]


# ---------------------------------------------------------------- stale answers, one truth, options

def test_a_rerun_is_a_fresh_job_a_resume_must_match_and_the_end_is_stamped_by_the_worker(redis_url, cdr, tmp_path):
    src = openai_lines(tmp_path / "asks.jsonl", 24, stop=["output"], seed=7)
    out = tmp_path / "out.jsonl"
    cli("run", src, "--workers", "1", "-o", str(out), url=redis_url)
    first = rows(out)
    assert len(first) == 24
    # the options travelled with the item to the engine: sim cuts its placeholder before "output"
    assert all(r["output"] == "<sim " and r["payload"]["options"] == {"stop": ["output"], "seed": 7} for r in first)
    # the worker that wrote the last result stamped the job's end; nobody read the job before this
    ended = cdr.r.hgetall(K.ModelKeys("m").job("asks"))
    assert ended[b"end"] == b"completed"
    last = max(int(x.split(b"-")[0]) for x, _ in cdr.r.xrange(K.ModelKeys("m").job_results("asks")))
    assert int(ended[b"ended_ms"]) == last
    # the same status from every reader (the job list derives it as conductor status and the API do)
    assert [j["state"] for j in json.loads(cli("jobs", "--json", url=redis_url).stdout)] == ["completed"]

    # a rerun of the same file with other options is a new job, not the old answers
    p = cli("run", src, "--workers", "1", "--max-batch-size", "4", "-o", str(out), url=redis_url)
    assert "this run is job asks-2" in p.stderr.decode()
    again = rows(out)
    assert len(again) == 24 and {r["job"] for r in again} == {"asks-2"} and max(r["batch_size"] for r in again) <= 4

    # a job named that exists: refused, naming the way on; a resume with other options: refused
    err = refusal(cli("run", src, "--job", "asks", "-o", str(out), url=redis_url, check=False))
    assert "--resume" in err and "--job" in err
    err = refusal(cli("run", src, "--job", "asks", "--resume", "--max-batch-size", "4", "-o", str(out),
                      url=redis_url, check=False))
    assert "ran with --max-batch-size 64" in err and "asks --max-batch-size 4" in err
    assert {r["job"] for r in rows(out)} == {"asks-2"}  # nothing written by the refusals


def test_options_no_engine_honours_are_refused_naming_the_field(redis_url, tmp_path):
    refused = [({"logprobs": True}, "body.logprobs"), ({"n": 3}, "body.n"),
               ({"response_format": {"type": "json_object"}}, "body.response_format"),
               ({"frequency_penalty": 0.5}, "body.frequency_penalty"), ({"temperature": 3}, "body.temperature"),
               ({"reasoning_effort": "low"}, "body.reasoning_effort")]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(Path(openai_lines(tmp_path / f"{k}.jsonl", 1, **body)).read_text().replace('"r0"', f'"r{k}"')
                           for k, (body, _) in enumerate(refused)))
    p = cli("submit", "--create", str(src), "--job", "o", url=redis_url, check=False)
    err = p.stderr.decode()
    assert p.returncode == 2 and "nothing submitted" in err
    for k, (_, field) in enumerate(refused):
        assert f"line {k + 1}: {field}:" in err, (field, err)


def test_cancelled_answers_keep_payload_and_tokens_and_every_reader_says_cancelled(redis_url, cdr, tmp_path):
    cdr.submit([item(f"i{k}", 10 + k, payload={"row": k, "tag": "x,y]"}) for k in range(6)], "c")
    assert cli("cancel", "c", url=redis_url).stdout.decode().startswith("job c: cancelled")
    got = {r["id"]: r for r in map(json.loads, cli("results", "c", url=redis_url).stdout.splitlines())}
    assert {k: (r["error"]["code"], r["input_tokens"], r["payload"]) for k, r in got.items()} == \
        {f"i{k}": ("cancelled", 10 + k, {"row": k, "tag": "x,y]"}) for k in range(6)}
    assert [j["state"] for j in json.loads(cli("jobs", "--json", url=redis_url).stdout)] == ["cancelled"]


# ---------------------------------------------------------------- lost input, write errors

def test_no_command_writes_over_its_input(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n")
    before = src.read_bytes()
    (tmp_path / "sym.jsonl").symlink_to(src)
    os.link(src, tmp_path / "hard.jsonl")
    for argv in (["run", str(src), "-o", str(src)], ["run", str(src), "-o", str(tmp_path / "hard.jsonl")],
                 ["submit", "--create", str(src), "--rejects", str(tmp_path / "sym.jsonl")]):
        err = one_line_error(cli(*argv, url=redis_url, check=False))
        assert "is the input file" in err and "refusing to write over it" in err, argv
    assert src.read_bytes() == before


def test_every_write_error_is_one_line_naming_the_path(redis_url, cdr, tmp_path):
    quick(cdr)
    cdr.submit([item(f"i{k}", 10, payload="x" * 100) for k in range(200)], "j")
    drain(cdr, Contract(model="m", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096))
    err = one_line_error(cli("results", "j", "-o", "/dev/full", url=redis_url, check=False))
    assert err == "conductor: cannot write /dev/full: No space left on device"
    with open("/dev/full", "wb") as full:
        err = one_line_error(subprocess.run([sys.executable, "-m", "conductor", "results", "j"], stdout=full,
                                            stderr=subprocess.PIPE, cwd=str(ROOT),
                                            env=dict(os.environ, CONDUCTOR_REDIS_URL=redis_url)))
    assert err == "conductor: cannot write standard output: No space left on device"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n" + '{"id": "b"}\n')
    err = refusal(cli("submit", "--create", "--skip-invalid", "--rejects", "/dev/full", str(bad), url=redis_url,
                      check=False))
    assert err == "conductor: cannot write /dev/full: No space left on device"  # after the refused line's report
    src = tmp_path / "ok.jsonl"
    src.write_text("".join(json.dumps({"id": f"k{k}", "model": "m", "prompt": "x" * 300, "max_tokens": 2}) + "\n"
                           for k in range(40)))
    err = refusal(cli("run", str(src), "--workers", "1", "-o", "/dev/full", url=redis_url, check=False))
    assert err == "conductor: cannot write /dev/full: No space left on device"


# ---------------------------------------------------------------- orphans

def _procs_naming(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line holds ``marker``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != "Z":
            out.append(int(d))
    return out


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _launch(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A ``conductor run`` on its embedded Redis, in a process group of its own (as a shell starts a
    job), with about ten seconds of simulated work."""
    tmp_path.mkdir(exist_ok=True)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"i{k}", "model": "m", "prefix": [f"system {k % 3}"], "prompt": "p",
                                       "input_tokens": 20, "max_tokens": 16}) + "\n" for k in range(3000)))
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    env = {k: v for k, v in os.environ.items() if k != "CONDUCTOR_REDIS_URL"}
    p = subprocess.Popen([sys.executable, "-m", "conductor", "run", str(src), "--workers", "1", "--max-batch-size",
                          "32", "--sim-time-scale", "5", "-o", str(out)], cwd=str(ROOT), stderr=subprocess.PIPE,
                         env=dict(env, CONDUCTOR_PROGRESS_S="0"), start_new_session=True)
    return p, out


def _going(p: subprocess.Popen, out: Path) -> tuple[int, Path]:
    """Once results are coming: the embedded server's port and folder."""
    port, deadline = 0, time.monotonic() + 60
    assert p.stderr is not None
    while True:
        line = p.stderr.readline()
        assert line and time.monotonic() < deadline, "the run did not get going"
        if m := re.search(rb"embedded redis-server on redis://127.0.0.1:(\d+)", line):
            port = int(m.group(1))
        if (m := re.search(rb": (\d+)/3000 results", line)) and int(m.group(1)) > 0:
            break
    # redis-server names itself "redis-server 127.0.0.1:PORT" and works in its --dir
    redis_dir = next(Path(os.readlink(f"/proc/{pid}/cwd")) for pid in _procs_naming(f"127.0.0.1:{port}")
                     if b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes())
    assert redis_dir.name.startswith("conductor-redis-")
    assert out.read_text() == "earlier\n"  # results go to a temporary name until complete
    return port, redis_dir


def _nothing_left(port: int) -> None:
    # the workers name the embedded server's address on their command line, the server in its title
    deadline = time.monotonic() + 10  # a killed child's exit is asynchronous; this is slack on a loaded machine
    while _procs_naming(f"127.0.0.1:{port}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _procs_naming(f"127.0.0.1:{port}")
    assert not _listening(port)


def test_a_signal_stops_workers_and_redis_writes_what_completed_and_leaves_nothing(tmp_path):
    """SIGINT, SIGTERM and SIGHUP to three runs at once, each to its process group (a terminal's
    Ctrl-C, `timeout`, a closed terminal), and SIGKILL to a fourth: the kernel's parent-death
    signal then stops its children, since no handler runs."""
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]
    runs = [_launch(tmp_path / sig.name) for sig in sigs]
    try:
        going = [_going(p, out) for p, out in runs]
        sent = time.monotonic()
        for sig, (p, _) in zip(sigs, runs, strict=True):
            os.killpg(p.pid, sig) if sig != signal.SIGKILL else p.kill()
        codes = [p.wait(20) for p, _ in runs]
        took = time.monotonic() - sent
        errs = [p.stderr.read().decode() for p, _ in runs if p.stderr is not None]
    finally:
        for p, _ in runs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stderr is not None:
                p.stderr.close()
    assert codes == [130, 143, 129, -9], errs
    assert took < 8, took  # each about 1.5 s alone; the slack is for four at once on a loaded machine
    for sig, (_, out), err in zip(sigs[:3], runs, errs, strict=False):
        assert "Traceback" not in err
        # the earlier output is kept as it was; what completed went beside it, named (issue 37)
        part = out.parent / "out.partial.jsonl"
        assert out.read_text() == "earlier\n"
        done = rows(part)
        m = re.search(rf"stopped by {sig.name}: (\d+) results written to {re.escape(str(part))} "
                      rf"\({re.escape(str(out))} kept as it was\), (\d+) of 3000", err)
        assert m and int(m.group(1)) == len(done) > 0 and int(m.group(2)) == 3000 - len(done), err
        assert "the embedded Redis went with this run, and the job with it: a rerun starts over: " in err
        assert "--resume" not in err.splitlines()[-1]
        assert len({r["id"] for r in done}) == len(done)
        assert not list(out.parent.glob(".out.jsonl.*.part"))
    for sig, (port, redis_dir) in zip(sigs, going, strict=True):
        _nothing_left(port)
        assert sig == signal.SIGKILL or not redis_dir.exists()


# ---------------------------------------------------------------- typos and smaller trips

def test_unknown_models_are_refused_with_a_did_you_mean_and_config_checks_relations(redis_url, cdr):
    cdr.submit([item("a", 10, model="demo-7b")], "j")
    for argv in (["inspect", "demo7b", "--verify"], ["worker", "--model", "demo7b", "--idle-exit", "1"]):
        err = one_line_error(cli(*argv, url=redis_url, check=False))
        assert "model 'demo7b' is unknown to this Redis; did you mean 'demo-7b'?" in err, argv
    assert cdr.models() == ["demo-7b"]
    err = one_line_error(cli("status", "jj", url=redis_url, check=False))
    assert "job 'jj' is unknown to this Redis; did you mean 'j'?" in err
    err = one_line_error(cli("config", "demo-7b", "lane_thr_min=5", url=redis_url, check=False))
    assert "lane_thr_min (5.0) must not exceed lane_thr_max (0.3)" in err
    assert cdr.config("demo-7b").get("lane_thr_min") is None


def test_global_options_after_the_command_a_bom_a_missing_field_and_pending_results(redis_server, tmp_path):
    url = redis_server.url
    from conductor.client import Conductor, connect
    r = connect(url)
    r.flushall()
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps({"id": f"i{k}", "model": "m", "prompt": "hi",
                                                             "max_tokens": 4}).encode() + b"\n" for k in range(5))
                    + b'{"id": "x", "model": "m", "max_tokens": 4}\n')
    env = {k: v for k, v in os.environ.items() if k != "CONDUCTOR_REDIS_URL"}
    base = [sys.executable, "-m", "conductor"]
    p = subprocess.run(base + ["submit", "--create", str(src), "--job", "b", "--redis", url, "--log-level", "warning"],
                       capture_output=True, env=env, cwd=str(ROOT))
    assert p.returncode == 2 and b"line 6: prompt: missing" in p.stderr and b"line 1" not in p.stderr, p.stderr
    subprocess.run(base + ["submit", "--create", str(src), "--job", "b", "--skip-invalid", "--redis", url], check=True,
                   capture_output=True, env=env, cwd=str(ROOT))
    c = Conductor(r)
    quick(c)
    b, _ = c.claim(Contract(model="m", max_batch_size=2, max_batch_tokens=8192, max_input_len=4096), "w")
    from tests.helpers import results_for
    c.complete(b, results_for(b))
    p = subprocess.run(base + ["results", "b", "--redis", url], capture_output=True, env=env, cwd=str(ROOT))
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 2
    assert p.stderr.decode().strip() == ("conductor: job b is still running: 3 of 5 items have no result yet "
                                         "(--follow waits for them)")
