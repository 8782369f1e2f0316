"""systemd: the notify protocol against a real AF_UNIX datagram socket (path and abstract),
a real worker process that speaks it (READY, WATCHDOG, STOPPING), and the unit template
(checked key by key here, and by ``systemd-analyze verify`` where the tool exists)."""

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conductor.cli.main import build_parser
from conductor.redis_contract import keys as K
from conductor.workers.sdnotify import Notifier, socket_address, watchdog_interval
from tests.conftest import ROOT, item
from tests.helpers import quick

UNIT = ROOT / "deploy" / "systemd" / "conductor-worker@.service"
ENV_EXAMPLE = ROOT / "deploy" / "systemd" / "worker.env.example"


@pytest.fixture()
def dgram(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    s.bind(path)
    s.settimeout(10)
    yield s, path
    s.close()


def test_ready_and_status_arrive_as_one_datagram(dgram):
    s, path = dgram
    n = Notifier(path)
    assert n.ready("pulling for m")
    assert s.recv(4096) == b"READY=1\nSTATUS=pulling for m"
    assert n.stopping() and s.recv(4096) == b"STOPPING=1"
    assert n.watchdog() and s.recv(4096) == b"WATCHDOG=1"
    assert n.status("two\nlines") and s.recv(4096) == b"STATUS=two lines"  # one field stays one field


def test_abstract_socket_names_start_with_at():
    name = f"@conductor-test-{os.getpid()}-{time.monotonic_ns()}"
    assert socket_address(name) == b"\0" + name[1:].encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(socket_address(name))
        s.settimeout(10)
        assert Notifier(name).ready()
        assert s.recv(4096) == b"READY=1"


def test_without_notify_socket_nothing_is_sent_and_a_dead_socket_does_not_raise(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not Notifier().enabled and Notifier().ready() is False
    assert Notifier(str(tmp_path / "gone.sock")).ready() is False


def test_watchdog_interval_is_half_of_watchdog_usec_and_only_for_this_process():
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({}) is None and watchdog_interval({"WATCHDOG_USEC": "0"}) is None


def test_a_worker_process_speaks_ready_watchdog_stopping(cdr, redis_url, dgram):
    s, path = dgram
    quick(cdr)
    cdr.submit([item(f"i{k}", 10, max_tokens=64) for k in range(16)], "j")
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url, NOTIFY_SOCKET=path, WATCHDOG_USEC="200000")
    env.pop("WATCHDOG_PID", None)
    p = subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine", "sim",
                          "--model", "m", "--name", "sd", "--sim-time-scale", "1", "--drain-s", "5"],
                         env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        msgs = []
        while not any(m.startswith(b"READY=1") for m in msgs):
            msgs.append(s.recv(4096))
        assert cdr.r.hexists(K.ModelKeys("m").workers, "sd")  # READY only once registered
        t = time.monotonic()
        pings = 0
        while time.monotonic() - t < 0.8:
            pings += s.recv(4096) == b"WATCHDOG=1"
        assert 4 <= pings <= 12  # every 0.1 s: half of WATCHDOG_USEC
        p.send_signal(signal.SIGTERM)
        rest = []
        while not any(m.startswith(b"STOPPING=1") for m in rest):
            rest.append(s.recv(4096))
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert b"STATUS=draining" in next(m for m in rest if m.startswith(b"STOPPING=1"))


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """systemd's unit syntax: sections, KEY=VALUE lines, keys that may repeat, # comments."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = []
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"not a unit line: {line!r}"
        out[section].append((key.strip(), value.strip()))
    return out


def test_unit_template_has_the_keys_a_fleet_relies_on():
    unit = parse_unit(UNIT.read_text())
    svc = unit["Service"]
    one = {k: v for k, v in svc}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["Restart"] == "on-failure"
    assert int(one["WatchdogSec"]) >= 10
    assert ("Environment", "CUDA_VISIBLE_DEVICES=%i") in svc
    assert [v for k, v in svc if k == "EnvironmentFile"] == ["/etc/conductor/worker.env",
                                                            "-/etc/conductor/worker-%i.env"]
    assert unit["Install"] == [("WantedBy", "multi-user.target")]
    # TimeoutStopSec covers the worker's drain, with a margin to write back and exit
    argv = shlex.split(one["ExecStart"])
    drain = float(argv[argv.index("--drain-s") + 1])
    assert drain < int(one["TimeoutStopSec"]) <= drain + 30
    assert one["KillSignal"] == "SIGTERM"
    # the command line, with the instance and the example environment filled in, is one the CLI takes
    env = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
               if line and not line.startswith("#"))
    filled = [a.replace("%i", "3").replace("%H", "host") for a in argv[1:]]
    filled = [w for a in filled for w in (shlex.split(env["CONDUCTOR_WORKER_ARGS"])
                                          if a == "$CONDUCTOR_WORKER_ARGS" else [a])]
    args = build_parser().parse_args(filled)
    # no --name: the default is the host plus the instance, which the unit hands over
    assert ("Environment", "CONDUCTOR_INSTANCE=%i") in svc
    assert (args.cmd, args.name, args.metrics_port, args.drain_s) == ("worker", None, 9503, drain)
    # one valid, distinct metrics port for every instance a host may run
    ports = {build_parser().parse_args([a.replace("%i", str(n)) for a in argv[1:-1]]
                                       + ["--model", "m"]).metrics_port for n in range(256)}
    assert len(ports) == 256 and max(ports) <= 65535
    assert (args.engine, args.high_water, args.low_water) == ("torch", 48, 16)
    assert env["CONDUCTOR_REDIS_URL"].startswith("redis")


def test_systemd_analyze_verify_accepts_the_template(tmp_path):
    tool = shutil.which("systemd-analyze")
    text = UNIT.read_text()
    if tool is None:
        # No systemd here: the key-by-key test above is the check; still prove the file is whole.
        assert text.count("[Service]") == 1 and "ExecStart=" in text
        return
    # verify wants an instance and an executable that exists: point ExecStart at this checkout's CLI
    exe = Path(sys.executable).parent / "conductor"
    assert exe.exists()
    inst = tmp_path / "conductor-worker@0.service"
    inst.write_text(text.replace("/opt/conductor/.venv/bin/conductor", str(exe)))
    p = subprocess.run([tool, "verify", str(inst)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "conductor-worker@" in ln]
    assert p.returncode == 0 and problems == [], p.stdout + p.stderr
    # and verify does catch a broken key, so the clean answer above means something
    inst.write_text(inst.read_text().replace("WatchdogSec=30", "WatchdogSec=soon"))
    p = subprocess.run([tool, "verify", str(inst)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert "WatchdogSec" in p.stdout + p.stderr or "sec value" in p.stdout + p.stderr
