"""A worker's name: host plus systemd instance by default (stable across restarts), one live
process per name, and a restart under the same name taking back at once what the last run left."""

import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter

from conductor.redis_contract import keys as K
from conductor.workers.identity import default_worker_name, systemd_instance
from tests.conftest import ROOT, cli, item
from tests.helpers import MK, quick
from tests.test_cli_basics import one_line_error
from tests.test_worker_drain import events, start_worker, wait_for

HOST = socket.gethostname().split(".")[0]


def test_the_default_name_is_the_host_plus_the_systemd_instance(tmp_path):
    cg = tmp_path / "cgroup"
    cg.write_text("0::/system.slice/system-conductor\\x2dworker.slice/conductor-worker@12.service\n")
    assert systemd_instance({"INVOCATION_ID": "abc"}, str(cg)) == "12"
    assert default_worker_name({"INVOCATION_ID": "abc"}, str(cg)) == f"{HOST}-12"
    cg.write_text("12:pids:/user.slice\n1:name=systemd:/system.slice/conductor-worker@3.service\n")  # cgroup v1
    assert default_worker_name({"INVOCATION_ID": "abc"}, str(cg)) == f"{HOST}-3"
    assert default_worker_name({"CONDUCTOR_INSTANCE": "7"}, str(cg)) == f"{HOST}-7"
    # not under systemd, or a unit that is no template: the host alone, the same on every start
    assert default_worker_name({}, str(cg)) == HOST
    cg.write_text("0::/system.slice/conductor.service\n")
    assert default_worker_name({"INVOCATION_ID": "abc"}, str(cg)) == HOST


def test_a_worker_process_without_a_name_registers_as_host_and_instance(cdr, redis_url):
    quick(cdr)
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url, CONDUCTOR_INSTANCE="5")
    p = subprocess.run([sys.executable, "-m", "conductor", "worker", "--engine", "sim", "--model", "m",
                        "--idle-exit", "0.2"], env=env, cwd=str(ROOT), capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    reg = [json.loads(ln) for ln in p.stderr.decode().splitlines() if ln.startswith("{")]
    assert [e["worker"] for e in reg if e["event"] == "registered"] == [f"{HOST}-5"]


def test_a_second_live_worker_under_the_same_name_is_refused(cdr, redis_url, tmp_path):
    quick(cdr)
    a = start_worker(redis_url, "twin", tmp_path / "a.log", "--heartbeat-ttl", "1.5")
    try:
        wait_for(lambda: cdr.r.exists(MK.heartbeat("twin")), what="the first twin to register")
        p = cli("worker", "--engine", "sim", "--model", "m", "--name", "twin", url=redis_url, check=False,
                timeout=60)
        err = one_line_error(p)
        assert "worker name 'twin' is in use by a live worker of m; give each worker its own --name" in err
        assert a.poll() is None  # the first one works on
    finally:
        a.terminate()
        assert a.wait(30) == 0


def test_a_restart_under_the_same_name_takes_back_what_the_killed_run_left(cdr, redis_url, tmp_path):
    quick(cdr)
    n = 48
    cdr.submit([item(f"i{k:03d}", 10, max_tokens=400) for k in range(n)], "j")
    a = start_worker(redis_url, "gpu0", tmp_path / "a.log", "--sim-time-scale", "1", "--heartbeat-ttl", "1")
    wait_for(lambda: cdr.r.xpending(MK.batches, K.GROUP)["pending"] >= 2, what="the first run to claim")
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    left = cdr.r.xpending(MK.batches, K.GROUP)["pending"]
    assert left >= 2
    b = start_worker(redis_url, "gpu0", tmp_path / "b.log", "--heartbeat-ttl", "1", "--idle-exit", "1")
    assert b.wait(60) == 0
    took = [e for e in events(tmp_path / "b.log") if e["event"] == "took_back"]
    assert took and took[0]["batches"] == left  # at start, not after the stale sweep (10 s here)
    rows = [json.loads(r) for r in cdr.results("j")]
    assert Counter(r["id"] for r in rows) == Counter(f"i{k:03d}" for k in range(n))
