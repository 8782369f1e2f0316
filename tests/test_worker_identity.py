"""A worker's name: host plus systemd instance under a template unit (stable across restarts),
else a free name of the host's (host, host-2, ...); one live process per name, and a restart under
a stable name taking back at once what the last run left."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

from conductor.client import Conductor, connect
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
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


def start_unnamed(url: str, log_path, *extra: str, **env_extra: str) -> subprocess.Popen:
    """A worker process started as a plain host would start it: no --name, not under systemd."""
    env = {k: v for k, v in os.environ.items() if k not in ("INVOCATION_ID", "CONDUCTOR_INSTANCE")}
    env.update(CONDUCTOR_REDIS_URL=url, **env_extra)
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "info", "worker", "--engine", "sim",
                                 "--model", "m", "--max-batch-size", "8", *extra],
                                env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log)


def test_workers_taking_a_free_name_at_the_same_moment_each_get_their_own(cdr, redis_url):
    n = 16
    conns = [Conductor(connect(redis_url)) for _ in range(n)]
    names: list = [None] * n
    go = threading.Barrier(n)

    def take(i: int) -> None:
        go.wait()
        names[i] = calls.take_name(MK, "h", int(time.time() * 1000), 30_000).run(conns[i].scripts)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(names) == sorted(["h"] + [f"h-{k}" for k in range(2, n + 1)])
    assert all(0 < cdr.r.pttl(MK.heartbeat(name)) <= 30_000 for name in names)
    # a name whose heartbeat lapsed (its worker died) is free again; none is when all tried are live
    cdr.r.delete(MK.heartbeat("h-5"))
    assert calls.take_name(MK, "h", 1, 30_000).run(cdr.scripts) == "h-5"
    assert calls.take_name(MK, "h", 1, 30_000, tries=3).run(cdr.scripts) is None


def test_workers_without_a_name_on_one_host_all_run_and_finish_a_job(cdr, redis_url, tmp_path):
    quick(cdr)
    n = 6
    procs = [start_unnamed(redis_url, tmp_path / f"w{i}.log", "--sim-time-scale", "0.3") for i in range(n)]
    try:
        names = {HOST} | {f"{HOST}-{k}" for k in range(2, n + 1)}
        wait_for(lambda: {w.decode() for w in cdr.r.hkeys(MK.workers)} == names, timeout=90,
                 what="six workers to register under the host's free names")
        assert all(p.poll() is None for p in procs)  # none refused: all run
        ids = [f"i{k:03d}" for k in range(240)]
        cdr.submit([item(i, 10 + k % 40, max_tokens=32, prefix=(f"S{k % 6}",)) for k, i in enumerate(ids)], "j")
        wait_for(lambda: cdr.status("j")["done"], timeout=120, what="the job to finish")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(60) for p in procs]
    assert codes == [0] * n
    rows = [json.loads(r) for r in cdr.results("j")]
    assert Counter(r["id"] for r in rows) == Counter(ids)  # every item exactly once
    assert {r["worker"] for r in rows} <= names
    took = sorted(e["worker"] for i in range(n) for e in events(tmp_path / f"w{i}.log") if e["event"] == "registered")
    assert took == sorted(names)


def test_a_restart_under_a_stable_name_takes_back_its_batches_before_its_heartbeat_could_lapse(cdr, redis_url,
                                                                                               tmp_path):
    """Under systemd (CONDUCTOR_INSTANCE here) the restarted process has the dead one's name; it sees
    that process gone from this host and takes its batches back at once, not after the 30 s TTL."""
    quick(cdr)
    n = 32
    cdr.submit([item(f"i{k:03d}", 10, max_tokens=400) for k in range(n)], "j")
    a = start_unnamed(redis_url, tmp_path / "a.log", "--sim-time-scale", "1", "--heartbeat-ttl", "30",
                      CONDUCTOR_INSTANCE="3")
    wait_for(lambda: cdr.r.xpending(MK.batches, K.GROUP)["pending"] >= 2, timeout=60, what="the first run to claim")
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    killed = time.monotonic()
    lapse_s = cdr.r.pttl(MK.heartbeat(f"{HOST}-3")) / 1000
    left = cdr.r.xpending(MK.batches, K.GROUP)["pending"]
    assert left >= 2 and lapse_s > 20
    b = start_unnamed(redis_url, tmp_path / "b.log", "--heartbeat-ttl", "30", "--idle-exit", "1",
                      CONDUCTOR_INSTANCE="3")
    wait_for(lambda: any(e["event"] == "took_back" for e in events(tmp_path / "b.log")), timeout=60,
             what="the restart to take back the batches")
    assert time.monotonic() - killed < lapse_s  # the dead run's heartbeat still lived: no sweep could have
    took = next(e for e in events(tmp_path / "b.log") if e["event"] == "took_back")
    assert took["worker"] == f"{HOST}-3" and took["batches"] == left
    assert b.wait(60) == 0
    rows = [json.loads(r) for r in cdr.results("j")]
    assert Counter(r["id"] for r in rows) == Counter(f"i{k:03d}" for k in range(n))
