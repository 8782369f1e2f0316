"""The host agent (seed 001's same-host handoff): one process claims for the GPU processes of its
host and hands their batches over shared-memory rings.

    conductor agent --model M --gpus N [engine flags]

It starts N GPU processes (workers/handoff_gpu.py), each with a ring (workers/shm_ring.py) it
writes and the process maps read-only, and a control socket. To Redis it is one worker: one
consumer name, one heartbeat (which extends the lease of every batch any of its GPU processes
holds), one maintenance lease; it claims with claim.lua under the GPU processes' contract (each
reports it from its engine; they must agree) whenever a GPU process has room (``depth`` batches
at most each: one running, the next waiting in its ring), and blocks on the model's doorbell
when there is no work.

Results come back through the agent, which writes them with complete.lua: the batch is pending
under the agent's consumer name, so the agent is the one that can acknowledge it and the one
whose heartbeat must stop leasing it; and a GPU process then needs no Redis connection,
credentials or retry logic of its own.

Failure rules, as for a worker: a GPU process that dies (its socket reaches end-of-file) has its
unfinished batches failed back with fail.lua (deliveries counted, dead-lettered at the limit)
and is started again; a dead agent's GPU processes see end-of-file and exit, and its batches,
pending under its name with no heartbeat, are reclaimed by any live worker's maintenance sweep.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from conductor.client import Conductor
from conductor.errors import ConductorError
from conductor.redis_contract.records import Batch, BatchItem, Contract

from .doorbell import Doorbell, poll_sleep
from .engines.base import Finished
from .handoff_wire import Done, FrameReader, Handoff, Hello, Message, Refused, Took, encode
from .identity import default_worker_name
from .idle import IdleBeat
from .shm_ring import KIND_BATCH, RingFull, RingWriter
from .transient import RIDE_OUT, is_transient
from .worker import Worker, WorkerOptions, event


class _Remote:
    """Stands in for the engine in the Worker base class: the engines run in the GPU processes."""

    def __init__(self, kind: str, contract: Contract) -> None:
        self.kind = f"handoff:{kind}"
        self.contract = contract
        self.model = contract.model

    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        raise NotImplementedError("the agent hands batches to its GPU processes")

    def step(self) -> list[Finished]:
        return []

    def active(self) -> int:
        return 0

    def room(self) -> int | None:
        """The agent paces its GPU processes itself (--depth batches each)."""
        return None

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        """The pre-warm signal is not passed on to GPU processes (yet)."""

    def close(self) -> None:
        pass


@dataclass
class _Gpu:
    index: int
    name: str
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    ring: RingWriter
    frames: FrameReader = field(default_factory=FrameReader)
    hello: Hello | None = None
    outstanding: dict[str, Batch] = field(default_factory=dict)  # by Batch.key
    alive: bool = True


class HostAgent(Worker):
    def __init__(self, conductor: Conductor, engine_spec: dict[str, Any], gpus: int,
                 opts: WorkerOptions | None = None, *, depth: int = 2, ring_bytes: int = 8 << 20,
                 start_timeout_s: float = 120.0) -> None:
        if gpus < 1 or depth < 1:
            raise ValueError(f"gpus: {gpus} and depth: {depth} must be at least 1")
        self.engine_spec, self.depth, self.ring_bytes = dict(engine_spec), depth, ring_bytes
        self.gpus: list[_Gpu] = []
        self.sel = selectors.DefaultSelector()
        self.claim_to_engine_ms: list[float] = []
        self.gpu_deaths = 0
        opts = replace(opts or WorkerOptions())
        opts.name = opts.name or default_worker_name()  # one agent per host: the host's name
        try:
            for i in range(gpus):
                self.gpus.append(self._spawn(i, opts.name))
            hello = self._await_hellos(start_timeout_s)
        except BaseException:
            # a failed or interrupted start (SIGTERM while engines load) leaves no GPU process behind
            self.close_gpus()
            raise
        super().__init__(conductor, _Remote(hello.kind, hello.contract), opts)
        self._room = threading.Condition(self._lock)
        self._completer: threading.Thread | None = None
        self._completer_error: BaseException | None = None

    # ------------------------------------------------------------------ GPU processes
    def _spawn(self, index: int, base: str) -> _Gpu:
        ours, theirs = socket.socketpair()
        ring = RingWriter(self.ring_bytes)
        cmd = [sys.executable, "-m", "conductor.workers.handoff_gpu", "--fd", str(theirs.fileno()),
               "--ring", ring.name, "--name", f"{base}/gpu{index}", "--engine", json.dumps(self.engine_spec)]
        proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=self._gpu_env(index))
        theirs.close()
        gpu = _Gpu(index, f"{base}/gpu{index}", proc, ours, ring)
        self.sel.register(ours, selectors.EVENT_READ, gpu)
        event("gpu_started", gpu=gpu.name, pid=proc.pid, ring=ring.name)
        return gpu

    @staticmethod
    def _gpu_env(index: int) -> dict[str, str]:
        """GPU process ``index`` sees one device: the index-th of the agent's CUDA_VISIBLE_DEVICES
        (all devices when unset), as the systemd template gives each worker its instance's GPU."""
        env = dict(os.environ)
        seen = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = seen[index % len(seen)] if seen else str(index)
        return env

    def _await_hellos(self, timeout_s: float) -> Hello:
        deadline = time.monotonic() + timeout_s
        while any(g.hello is None for g in self.gpus):
            if time.monotonic() > deadline:
                self.close_gpus()
                raise ConductorError(f"agent: GPU processes did not start within {timeout_s:g}s")
            for key, _ in self.sel.select(timeout=0.5):
                gpu: _Gpu = key.data
                if not self._receive(gpu):
                    self.close_gpus()
                    raise ConductorError(f"agent: GPU process {gpu.name} exited at start "
                                         f"(status {gpu.proc.wait()}); see its error above")
        contracts = {g.hello.contract for g in self.gpus if g.hello is not None}
        if len(contracts) != 1:
            self.close_gpus()
            raise ConductorError(f"agent: GPU processes report different contracts: {sorted(map(str, contracts))}")
        first = self.gpus[0].hello
        assert first is not None
        return first

    def _receive(self, gpu: _Gpu) -> bool:
        """Read what ``gpu`` sent and act on it; False at end-of-file (the process is gone)."""
        try:
            data = gpu.sock.recv(1 << 20)
        except ConnectionResetError:
            data = b""
        if not data:
            return False
        try:
            msgs = gpu.frames.feed(data)
        except ValueError as e:  # a frame that does not decode: the process is broken
            event("gpu_broken", gpu=gpu.name, error=str(e))
            gpu.proc.kill()
            return False
        for msg in msgs:  # a failure to act on one is the agent's, not the process's: it reaches run()
            self._handle(gpu, msg)
        return True

    def _handle(self, gpu: _Gpu, msg: Message) -> None:
        if isinstance(msg, Hello):
            gpu.hello = msg
            gpu.ring.unlink()  # mapped by both ends now: nothing is left in /dev/shm after a SIGKILL
        elif isinstance(msg, Took):
            with self._lock:
                gpu.ring.ack(msg.pos)
                self.claim_to_engine_ms.append(msg.claim_to_engine_ms)
                del self.claim_to_engine_ms[:-100_000]
        elif isinstance(msg, Done):
            batch = gpu.outstanding.get(msg.key)
            if batch is not None:
                self._write(batch, msg)
                self._release(gpu, msg.key)
                self.finished += len(msg.results)
        elif isinstance(msg, Refused):
            batch = gpu.outstanding.get(msg.key)
            if batch is not None:
                self._fail_back(batch, msg.error)
                self._release(gpu, msg.key)

    def _release(self, gpu: _Gpu, key: str) -> None:
        with self._room:
            gpu.outstanding.pop(key, None)
            self._room.notify_all()

    def _write(self, batch: Batch, done: Done) -> None:
        """complete.lua, retried while Redis is away (the batch stays leased meanwhile)."""
        sleep = 0.01
        while True:
            try:
                self.c.complete(batch, done.results, final=True)
                self.metrics.written(done.results)
                return
            except RIDE_OUT as e:
                if not is_transient(e) or self._hb_stop.is_set():
                    # left pending under this agent: a reclaim hands it on (results are idempotent)
                    event("complete_failed", worker=self.name, batch=batch.batch_id, error=str(e))
                    return
                event("complete_retry", worker=self.name, batch=batch.batch_id, error=str(e))
                sleep = poll_sleep(sleep, 1.0)

    def _fail_back(self, batch: Batch, reason: str) -> None:
        event("handoff_failed_back", worker=self.name, batch=batch.batch_id, reason=reason)
        try:
            self.c.fail(batch, self.name, reason)
        except RIDE_OUT as e:
            # pending under this agent: the reclaim after it stops picks it up
            event("fail_write_failed", worker=self.name, batch=batch.batch_id, error=str(e))

    def _gpu_died(self, gpu: _Gpu) -> None:
        self.sel.unregister(gpu.sock)
        gpu.sock.close()
        status = gpu.proc.wait()
        self.gpu_deaths += 1
        event("gpu_died", gpu=gpu.name, pid=gpu.proc.pid, status=status, batches=len(gpu.outstanding))
        with self._room:
            gpu.alive = False  # from here on _hand gives nothing more to it
            lost = list(gpu.outstanding.values())
            gpu.outstanding.clear()
        for batch in lost:
            self._fail_back(batch, f"GPU process {gpu.name} died (status {status})")
        with self._room:
            gpu.ring.close()
        if not self.stopping.is_set():
            fresh = self._spawn(gpu.index, self.name)
            with self._room:
                self.gpus[gpu.index] = fresh
                self._room.notify_all()

    def _complete_loop(self) -> None:
        """The completer thread: every GPU process's messages, results written as they come."""
        try:
            self._receive_until_stopped()
        except BaseException as e:  # noqa: BLE001 - any failure: said, and run() raises it
            # Nothing would write results from here on while the heartbeat thread kept their batches
            # leased: the agent stops claiming, hands its batches back at once and exits with the error.
            self._completer_error = e
            event("completer_failed", worker=self.name, error=repr(e))
            self.stopping.set()
            with self._room:
                self._room.notify_all()

    def _receive_until_stopped(self) -> None:
        while not self._hb_stop.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                gpu: _Gpu = key.data
                if not self._receive(gpu):
                    self._gpu_died(gpu)

    # ------------------------------------------------------------------ handing over
    def leased_ids(self) -> list[str]:
        with self._lock:
            return [b.batch_id for g in self.gpus for b in g.outstanding.values()]

    def _gpu_with_room(self) -> _Gpu | None:
        # half the ring free: the next batch record fits (shm_ring.RingWriter.max_record)
        ready = [g for g in self.gpus if g.alive and g.hello is not None and len(g.outstanding) < self.depth
                 and g.ring.free() >= g.ring.capacity // 2]
        return min(ready, key=lambda g: len(g.outstanding)) if ready else None

    def _hand(self, gpu: _Gpu, batch: Batch, claim_start: float) -> None:
        body = encode(Handoff(batch=batch, claim_start=claim_start))
        try:
            with self._room:
                if not gpu.alive:
                    raise OSError("the process died")
                gpu.outstanding[batch.key] = batch  # before the wake-up: its answer may be quick
                pos = gpu.ring.write(KIND_BATCH, body)
            gpu.sock.sendall(pos.to_bytes(8, "little"))
        except (RingFull, ValueError, OSError) as e:
            with self._room:
                gpu.outstanding.pop(batch.key, None)
            self._fail_back(batch, f"handoff to {gpu.name}: {e}")

    def _claim_for(self, gpu: _Gpu) -> bool:
        t0 = time.monotonic()
        try:
            batch, self.last_claim = self.shards.claim(self.contract, self.name)
        except RIDE_OUT as e:
            if not is_transient(e):
                raise
            event("claim_failed", worker=self.name, error=str(e))
            time.sleep(0.05)
            return False
        self.metrics.claim_took(time.monotonic() - t0)
        if batch is None:
            return False
        self.batches_claimed += 1
        self.metrics.claimed(batch)
        self._hand(gpu, batch, t0)
        return True

    def run(self) -> None:
        self.c.ensure_model(self.contract.model)
        self.take_name()
        self.register()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._hb_thread.start()
        self._completer = threading.Thread(target=self._complete_loop, name="completer", daemon=True)
        self._completer.start()
        try:
            self._claim_loop()
            self.drain()
        finally:
            self.stopping.set()
            self._stop_heartbeat()
            if self._completer is not None:
                self._completer.join(timeout=5)
            self.deregister()
            self.close_gpus()
            event("agent_stopped", worker=self.name, **self.summary())
        if self._completer_error is not None:
            raise ConductorError(f"agent: its completer thread failed: {self._completer_error!r}") \
                from self._completer_error

    def _claim_loop(self) -> None:  # noqa: C901 - the worker loop's order (maintenance, room, claim, bell, exits) in one place
        from .shard_maintenance import for_worker
        maint = for_worker(self.c, self.shards, self.name, self.opts.heartbeat_ttl_s)  # each shard's too
        bell = Doorbell(self.c, self.shards.bell_model())
        self.bell = bell
        idle = IdleBeat(self, maint, bell)  # nothing waiting: one BLPOP and one beat a beat (issue 36)
        idle_since, rung = time.monotonic(), False
        while not self.stopping.is_set():
            maint.tick()
            if self.opts.max_batches is not None and self.batches_claimed >= self.opts.max_batches:
                if not self.leased_ids():
                    return
                time.sleep(0.01)
                continue
            with self._room:
                gpu = self._gpu_with_room()
                if gpu is None:
                    self._room.wait(timeout=max(0.001, min(0.5, maint.due_in())))
                    continue
            if self._claim_for(gpu):
                if rung:
                    self._pass_on(bell)
                rung, idle_since = False, time.monotonic()
                continue
            rung = False
            if self.last_claim == "paused" or self.leased_ids():
                idle_since = time.monotonic()
            if self.opts.idle_exit_s is not None and time.monotonic() - idle_since > self.opts.idle_exit_s:
                return
            got = idle.wait(self.last_claim, self.opts.idle_exit_s, idle_since)
            if got is None:
                time.sleep(0.05)
            rung = bool(got)

    def drain(self) -> None:
        """Stop claiming; let the GPU processes finish within ``drain_s``; hand back the rest."""
        deadline = time.monotonic() + self.opts.drain_s
        event("draining", worker=self.name, batches=len(self.leased_ids()))
        with self._room:
            while (self._completer_error is None and any(g.outstanding for g in self.gpus)
                   and time.monotonic() < deadline):
                self._room.wait(timeout=0.1)
        left = self.leased_ids()
        if left:
            try:
                res = self.members.reclaim(self.name)
                event("handed_back", worker=self.name, batches=res["batches"], requeued=res["items"])
            except RIDE_OUT as e:  # pending under this name; the next sweep hands them on
                event("hand_back_failed", worker=self.name, batches=len(left), error=str(e))
            with self._room:
                for g in self.gpus:
                    g.outstanding.clear()
        event("drained", worker=self.name, finished=self.finished)

    def close_gpus(self) -> None:
        """End-of-file on every control socket: each GPU process exits; then reap them."""
        for g in self.gpus:
            try:
                self.sel.unregister(g.sock)
            except (KeyError, ValueError):
                pass
            g.sock.close()
        for g in self.gpus:
            try:
                g.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                g.proc.kill()
                g.proc.wait()
            g.ring.close()

    def summary(self) -> dict[str, Any]:
        lat = list(self.claim_to_engine_ms)
        return {"batches": self.batches_claimed, "finished": self.finished, "gpu_deaths": self.gpu_deaths,
                "claim_to_engine_ms_p50": round(statistics.median(lat), 3) if lat else None}
