"""One GPU process under a host agent (``conductor agent``): no Redis, only its engine.

Started by workers/host_agent.py with the control socket as an inherited file descriptor and
the name of a ring the agent writes. It maps the ring read-only (workers/shm_ring.py), admits
each batch record into its engine, steps the engine, and sends each batch's results back whole
(the agent writes them with complete.lua: the batch is the agent's claim, pending under its
consumer name). When the socket reaches end-of-file, the agent is gone: the process exits at
once, its batches are the dead agent's, reclaimed by the existing sweep.

    python -m conductor.workers.handoff_gpu --fd N --ring NAME --name NAME --engine JSON
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

from conductor.errors import ConductorError
from conductor.redis_contract.records import Batch, Result, ResultError
from conductor.redis_contract.shards import fold  # a shard's results under its model's name

from .engines import make_engine
from .engines.base import Engine, Finished
from .handoff_wire import Done, Hello, Refused, Took, decode_handoff, send
from .shm_ring import KIND_BATCH, RingReader


@dataclass
class _Running:
    batch: Batch
    left: int
    results: list[Result] = field(default_factory=list)


class GpuProcess:
    def __init__(self, sock: socket.socket, ring: RingReader, engine: Engine, name: str) -> None:
        self.sock, self.ring, self.engine, self.name = sock, ring, engine, name
        self.running: dict[str, _Running] = {}

    def serve(self) -> None:
        send(self.sock, Hello(contract=self.engine.contract, kind=self.engine.kind, pid=os.getpid()))
        while True:
            ready, _, _ = select.select([self.sock], [], [], 0 if self.engine.active() else None)
            if ready:
                if not self.sock.recv(4096):  # only wake-ups arrive here; EOF: the agent is gone
                    return
                self._take()
            if self.engine.active():
                self._finish(self.engine.step())

    def _take(self) -> None:
        for kind, body in self.ring.read():
            if kind != KIND_BATCH:
                continue
            h = decode_handoff(body)
            b = h.batch
            self.running[b.key] = _Running(b, len(b.items))
            bad = [it for it in b.items if it.unreadable]
            items = [it for it in b.items if not it.unreadable]
            try:
                refused = self.engine.admit(b, items) if items else []
            except Exception as e:  # noqa: BLE001 - any engine failure: the agent fails the batch back
                del self.running[b.key]
                send(self.sock, Refused(key=b.key, error=f"engine {self.engine.kind}: {e!r}"))
                continue
            send(self.sock, Took(key=b.key, pos=self.ring.pos,
                                 claim_to_engine_ms=(time.monotonic() - h.claim_start) * 1000))
            self._finish(refused + [Finished(b, it, "", 0, ResultError("bad_record", it.unreadable)) for it in bad])

    def _finish(self, finished: list[Finished]) -> None:
        for fin in finished:
            run = self.running.get(fin.batch.key)
            if run is None:
                continue
            b, it = fin.batch, fin.item
            run.results.append(Result(
                id=it.id, model=fold(b.model), job=it.job, output=fin.output, output_tokens=fin.output_tokens,
                error=fin.error, shape=b.shape, epoch=b.epoch, lane=b.lane, batch=b.batch_id,
                batch_size=len(b.items), batch_padded_len=b.padded_len, input_tokens=it.input_tokens,
                worker=self.name, claimed_at=b.claimed_at, finished_at=int(time.time() * 1000),
                deliveries=it.deliveries, payload=it.payload))
            run.left -= 1
            if run.left == 0:
                del self.running[b.key]
                send(self.sock, Done(key=b.key, results=run.results))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="conductor.workers.handoff_gpu")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--ring", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--engine", required=True, help="JSON: {kind, and make_engine's keyword arguments}")
    a = p.parse_args(argv)
    # Ctrl-C reaches the whole foreground process group: the agent decides when its GPU processes
    # stop (end-of-file on the socket, after it drained), so they do not die mid-batch with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(a.engine)
    sock = socket.socket(fileno=a.fd)
    ring = RingReader(a.ring)
    try:
        engine = make_engine(spec.pop("kind"), **spec)
    except (ConductorError, ValueError) as e:  # the agent names the process; this line says why
        print(f"conductor agent: {a.name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    try:
        GpuProcess(sock, ring, engine, a.name).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the agent went away mid-send: same as end-of-file
    finally:
        engine.close()
        ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
