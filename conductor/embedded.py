"""A private redis-server for the life of one run (``conductor run`` without ``--redis``) or test.

It listens on 127.0.0.1 and a free port, keeps its files in a temporary folder, and is
stopped (and the folder removed) on exit. ``kill()`` and ``restart()`` exist for tests that
break things for real. The server also gets SIGTERM from the kernel when the process that started
it dies, however it dies (Linux), so that a SIGKILLed run, benchmark or test process leaves no
server behind; only a server started from another thread than the main one is not tied (the
kernel's tie is to the starting thread, which may end before the server should).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conductor.errors import RedisUnavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_PR_SET_PDEATHSIG = 1


def tie_to_parent(sig: int = signal.SIGTERM, own_group: bool = True) -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must not outlive the process starting it: the kernel sends
    it ``sig`` when this thread of the parent ends, even by SIGKILL (Linux; elsewhere only the
    group). ``own_group``: the child leads a process group of its own, so a terminal's Ctrl-C
    reaches only the parent, which then stops its children in order. Call it, and start the child,
    from the thread that lives as long as the child should (the main thread)."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def setup() -> None:
        if own_group:
            os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the line above: act as the kernel would
                os.kill(os.getpid(), sig)
    return setup


def child_tie() -> Callable[[], None] | None:
    """The ``preexec_fn`` that ties a helper child (a server, a benchmark's worker) to this process:
    ``tie_to_parent`` in its caller's process group, so that Ctrl-C still reaches both, when called
    from the main thread; None from any other thread, whose end would kill the child too early."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return tie_to_parent(own_group=False)


def find_server() -> str:
    path = os.environ.get("CONDUCTOR_REDIS_SERVER") or shutil.which("redis-server")
    if not path:
        raise RedisUnavailable(
            "no redis-server binary found for the embedded server: install it (Debian: apt-get install "
            "redis-server) or set CONDUCTOR_REDIS_SERVER, or pass --redis URL")
    return path


class EmbeddedRedis:
    def __init__(self, *, port: int | None = None, appendonly: bool = False, appendfsync: str = "always",
                 extra: list[str] | None = None, dir: str | None = None, cluster: bool = False,
                 own_all_slots: bool = True, die_with_parent: bool | None = None) -> None:
        self.port = port or free_port()
        # A port free_port() found can be taken before redis-server binds it (any outgoing connection
        # may get it from the same ephemeral range): a first start on ports chosen here tries new ones.
        self._ports_chosen = port is None
        self._started = False
        # cluster: a Redis Cluster node; with own_all_slots a one-node cluster owning every slot,
        # so that Redis itself refuses a command or script touching keys of two slots
        # (tests/test_cluster_slots.py); without, a member EmbeddedCluster assigns slots to.
        self.cluster = cluster
        self.own_all_slots = own_all_slots
        # The cluster bus port defaults to port + 10000, past 65535 for a high free port.
        self.bus_port = free_port() if cluster else 0
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra = extra or []
        self._own_dir = dir is None
        self.dir = Path(dir or tempfile.mkdtemp(prefix="conductor-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        # None: tied to this process when started (or restarted) from the main thread (child_tie)
        self.die_with_parent = die_with_parent

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = [find_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
                "--appendonly", "yes" if self.appendonly else "no",
                # a replica's first sync starts at once: the default waits 5 s for more replicas to join
                "--repl-diskless-sync-delay", "0"]
        if self.appendonly:
            args += ["--appendfsync", self.appendfsync]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                     "--cluster-port", str(self.bus_port)]
        return args + self.extra

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        for attempt in range(3):
            try:
                self._start(timeout)
                self._started = True
                return self
            except RedisUnavailable as e:
                if self._started or not self._ports_chosen or attempt == 2 or "Address already in use" not in str(e):
                    raise
                (self.dir / "redis.log").unlink(missing_ok=True)
                self.port = free_port()
                if self.cluster:
                    (self.dir / "nodes.conf").unlink(missing_ok=True)  # it would name the old ports
                    self.bus_port = free_port()
        raise AssertionError("unreachable")

    def _tie(self) -> Callable[[], None] | None:
        if self.die_with_parent is None:
            return child_tie()
        return tie_to_parent(own_group=False) if self.die_with_parent else None

    def _start(self, timeout: float) -> None:
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True,
                                     preexec_fn=self._tie())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:] \
                    if (self.dir / "redis.log").exists() else ""
                raise RedisUnavailable(f"embedded redis-server exited at start: {log}")
            try:
                # one try each: the loop is the retry, and looks at the process between two
                c = redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5,
                                retry=Retry(NoBackoff(), 0))
                if c.ping():
                    # AOF loading answers LOADING until done; wait for a usable server.
                    c.dbsize()
                    if self.cluster and self.own_all_slots:
                        self._own_all_slots(c, deadline)
                    c.close()
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError):
                # TimeoutError: something else listens on the port (the loop then sees the server exit)
                time.sleep(0.05)
        raise RedisUnavailable(f"embedded redis-server did not answer on port {self.port} in {timeout}s")

    def _own_all_slots(self, c: redis.Redis, deadline: float) -> None:
        if b"cluster_slots_assigned:16384" not in c.execute_command("CLUSTER", "INFO"):  # not after a restart
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        while time.monotonic() < deadline:
            if b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO"):
                return
            time.sleep(0.05)
        raise RedisUnavailable(f"embedded one-node cluster on port {self.port} never reached state ok")

    def kill(self) -> None:
        """SIGKILL: no shutdown save, exactly what a crash does."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_REPL_USER, _REPL_PASS = "repl", "replpw"  # a test cluster's replication user (EmbeddedCluster)


def _replicas_known(nodes: bytes, wanted: set[tuple[str, str]]) -> bool:
    """CLUSTER NODES lists each (address, primary id) of ``wanted`` as a replica of that primary."""
    seen = set()
    for line in nodes.decode().splitlines():
        f = line.split()
        if len(f) > 3 and "slave" in f[2].split(","):
            seen.add((f[1].split("@")[0], f[3]))  # ip:port@bus: the address without the bus port
    return wanted <= seen


class EmbeddedCluster:
    """A Redis Cluster of ``nodes`` primaries on free ports, slots split evenly, joined with CLUSTER
    MEET: for tests of a model's keys living on one node among several. ``replicas``: that many
    replicas of each primary (CLUSTER REPLICATE), in ``replicas_of[i]`` for ``nodes[i]``, for
    tests that fail a primary over (``failover``)."""

    def __init__(self, nodes: int = 3, replicas: int = 0) -> None:
        self.nodes = [EmbeddedRedis(cluster=True, own_all_slots=False) for _ in range(nodes)]
        self.replicas_of = [[EmbeddedRedis(cluster=True, own_all_slots=False) for _ in range(replicas)]
                            for _ in range(nodes)]

    @property
    def url(self) -> str:
        """A seed node, flagged for conductor.client.connect to build a cluster client."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0?cluster=1"

    def start(self, timeout: float = 20.0) -> EmbeddedCluster:
        try:
            return self._start(timeout)
        except BaseException:
            self.close()  # a start that failed halfway leaves no node running (nothing else would stop it)
            raise

    def _start(self, timeout: float) -> EmbeddedCluster:
        every = [*self.nodes, *(r for rs in self.replicas_of for r in rs)]
        for n in every:
            n.start(timeout)
        clients = [redis.Redis(port=n.port) for n in every]
        deadline = time.monotonic() + timeout
        try:
            step = 16384 // len(self.nodes)
            for i, c in enumerate(clients[:len(self.nodes)]):
                last = 16383 if i == len(self.nodes) - 1 else (i + 1) * step - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port, self.nodes[0].bus_port)
            self._wait(clients, deadline, lambda i: f"cluster_known_nodes:{len(every)}".encode() in i)
            replicas = [(p, r) for p, rs in zip(self.nodes, self.replicas_of, strict=True) for r in rs]
            if replicas:
                for c in clients:  # replication as a user of its own, which cut_replication switches off
                    c.acl_setuser(_REPL_USER, enabled=True, passwords=[f"+{_REPL_PASS}"], keys=["*"],
                                  channels=["*"], commands=["+@all"])
                    c.config_set("masteruser", _REPL_USER)
                    c.config_set("masterauth", _REPL_PASS)
            wanted: set[tuple[str, str]] = set()  # (replica's address, its primary's id)
            for primary, replica in replicas:
                primary_id = redis.Redis(port=primary.port).execute_command("CLUSTER", "MYID").decode()
                redis.Redis(port=replica.port).execute_command("CLUSTER", "REPLICATE", primary_id)
                wanted.add((f"127.0.0.1:{replica.port}", primary_id))
            while replicas and time.monotonic() < deadline:
                if all(redis.Redis(port=r.port).info("replication").get("master_link_status") == "up"
                       for _p, r in replicas):
                    break
                time.sleep(0.05)
            # Every node must know each replica as one before a planned failover can win its vote: the
            # sync itself is done in milliseconds (no diskless delay), the gossip about it later.
            self._wait(clients, deadline, lambda i: True,
                       lambda c: _replicas_known(c.execute_command("CLUSTER", "NODES"), wanted))
            return self
        finally:
            for c in clients:
                c.close()

    @staticmethod
    def _wait(clients: list[redis.Redis], deadline: float, also: Callable[[bytes], bool],
              node_ok: Callable[[redis.Redis], bool] = lambda _c: True) -> None:
        while time.monotonic() < deadline:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            if all(b"cluster_state:ok" in i and also(i) for i in infos) and all(node_ok(c) for c in clients):
                return
            time.sleep(0.05)
        raise RedisUnavailable("embedded cluster never reached state ok")

    def cut_replication(self, primary: int, timeout: float = 10.0) -> None:
        """The replicas of ``nodes[primary]`` lose their link and cannot make it again: what the
        primary writes from now on, it alone has (a failover then loses it), while every client
        of the primary goes on as before."""
        c = redis.Redis(port=self.nodes[primary].port)
        try:
            c.acl_setuser(_REPL_USER, enabled=False)
            c.client_kill_filter(user=_REPL_USER)
        finally:
            c.close()
        deadline = time.monotonic() + timeout
        for r in self.replicas_of[primary]:
            rc = redis.Redis(port=r.port)
            try:
                while rc.info("replication").get("master_link_status") != "down":
                    if time.monotonic() > deadline:
                        raise RedisUnavailable(f"replica on port {r.port} kept its link")
                    time.sleep(0.02)
            finally:
                rc.close()

    def failover(self, primary: int, how: str = "", timeout: float = 20.0) -> float:
        """Promote the first replica of ``nodes[primary]``: CLUSTER FAILOVER on it (``how`` empty:
        the planned form, the primary hands over once the replica has all its writes; "FORCE" or
        "TAKEOVER" without the primary, for one that died). The two swap places in ``nodes`` and
        ``replicas_of``; the seconds until the replica served as primary."""
        replica = self.replicas_of[primary][0]
        t0 = time.monotonic()
        c = redis.Redis(port=replica.port)
        try:
            c.execute_command("CLUSTER", "FAILOVER", *([how] if how else []))
            while c.info("replication").get("role") != "master" or \
                    b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                if time.monotonic() > t0 + timeout:
                    raise RedisUnavailable(f"replica on port {replica.port} was not promoted in {timeout}s")
                time.sleep(0.02)
        finally:
            c.close()
        took = time.monotonic() - t0
        self.replicas_of[primary][0], self.nodes[primary] = self.nodes[primary], replica
        return took

    def move_slot(self, slot: int, to: int, *, page_pause_s: float = 0.0) -> None:
        """Reshard one slot to node ``to`` the way redis-cli does: IMPORTING and MIGRATING marks,
        MIGRATE of its keys 10 at a time (redis-cli's --cluster-pipeline), then SETSLOT NODE on every node.
        ``page_pause_s``: a pause after each MIGRATE, so that a test's small slot stays half moved
        as long as a big one would."""
        cs = [redis.Redis(port=n.port) for n in self.nodes]
        try:
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in cs]
            port = next(int(row[2][1]) for row in cs[0].execute_command("CLUSTER", "SLOTS")
                        if row[0] <= slot <= row[1])
            owner = [n.port for n in self.nodes].index(port)
            if owner == to:
                return
            cs[to].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[owner])
            cs[owner].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to])
            while keys := cs[owner].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10):
                cs[owner].execute_command("MIGRATE", "127.0.0.1", self.nodes[to].port, "", 0, 5000, "KEYS", *keys)
                time.sleep(page_pause_s)
            for c in cs:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[to])
        finally:
            for c in cs:
                c.close()

    def close(self) -> None:
        for n in [*self.nodes, *(r for rs in self.replicas_of for r in rs)]:
            n.close()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
