"""What the host agent and its GPU processes say to each other (seed 001's same-host handoff).

Agent to GPU process: batch records in the shared-memory ring (workers/shm_ring.py), each a
``Handoff`` in msgspec JSON, and on the control socket only the ring's new write position
(8 bytes) as the wake-up. GPU process to agent: framed messages on the same socket
(``[u32 length][msgspec JSON]``, a tagged union): its contract once the engine is up, each
batch taken (with its ring read position, which frees ring space), each batch's results.
msgspec everywhere, no pickle: neither end runs what the other sends.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from conductor.redis_contract.records import Batch, Contract, Result

FRAME = struct.Struct("<I")
MAX_FRAME = 256 << 20  # a batch's results; anything larger is a broken peer


class Handoff(msgspec.Struct):
    batch: Batch
    claim_start: float  # time.monotonic() when the agent started the claim (one clock per host)


class Hello(msgspec.Struct, tag=True):
    contract: Contract
    kind: str
    pid: int


class Took(msgspec.Struct, tag=True):
    key: str  # Batch.key: a batch id alone is not unique over a sharded model's shards
    pos: int  # the ring position read up to
    claim_to_engine_ms: float  # from the claim's start to the batch's admit


class Done(msgspec.Struct, tag=True):
    key: str
    results: list[Result]


class Refused(msgspec.Struct, tag=True):
    key: str
    error: str  # the engine could not take the batch: the agent fails it back


Message = Hello | Took | Done | Refused
encode = msgspec.json.Encoder().encode
decode_handoff = msgspec.json.Decoder(Handoff).decode
_decode_message = msgspec.json.Decoder(Message).decode


def send(sock: socket.socket, msg: Message) -> None:
    body = encode(msg)
    sock.sendall(FRAME.pack(len(body)) + body)


class FrameReader:
    """Splits a stream socket's bytes into messages; ``feed`` returns the whole ones."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self.buf += data
        out: list[Message] = []
        while len(self.buf) >= FRAME.size:
            (n,) = FRAME.unpack_from(self.buf, 0)
            if n > MAX_FRAME:
                raise ValueError(f"frame: {n} bytes is over the {MAX_FRAME} limit")
            if len(self.buf) < FRAME.size + n:
                break
            out.append(_decode_message(bytes(self.buf[FRAME.size:FRAME.size + n])))
            del self.buf[:FRAME.size + n]
        return out
