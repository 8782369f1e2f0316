"""A one-writer, one-reader byte ring in shared memory (seed 001's same-host handoff).

The host agent writes batch records; one GPU process reads them. Records are addressed by
offsets into the segment, never by pointers: a record is ``[u32 length][u32 kind][body]`` at
``HEADER + (position % capacity)``, where a position counts bytes written since the ring was
made (it only grows). A record never wraps: when the rest of the segment is too short, the
writer fills it with a pad record (or leaves fewer than 8 bytes, which the reader skips) and
starts again at offset 0.

The reader maps the segment READ-ONLY: ``multiprocessing.shared_memory.SharedMemory`` always
maps read-write, so the reader opens ``/dev/shm/<name>`` with O_RDONLY and maps it with
``mmap.ACCESS_READ`` (Linux; a write through that map raises ``TypeError``). Because the reader
cannot write, its read position travels back to the writer over the control socket (the agent
reads it from each message a GPU process sends), and the writer never overwrites bytes past
that acknowledged position. The writer publishes its own position in the header, after the
record's bytes, and also sends it over the socket as the wake-up; the header copy is what a
reader trusts, so a stale notification can only make it read less.

Bodies are msgspec JSON (no pickle): the reader decodes data, never code.
"""

from __future__ import annotations

import mmap
import os
import struct
from multiprocessing import shared_memory

MAGIC = b"CDRRING1"
HEADER = 64  # magic (8), capacity (8), write position (8), the rest reserved
_HEAD = struct.Struct("<8sQQ")
_POS = struct.Struct("<Q")
_REC = struct.Struct("<II")
KIND_PAD = 0
KIND_BATCH = 1
SHM_DIR = "/dev/shm"


class RingFull(Exception):
    """The reader has not acknowledged enough bytes for this record yet."""


class RingWriter:
    """The agent's end: creates the segment and owns it (unlinks it on close)."""

    def __init__(self, capacity: int = 8 << 20) -> None:
        if capacity < 4096 or capacity % 8:
            raise ValueError(f"capacity: {capacity} must be a multiple of 8 and at least 4096")
        self.capacity = capacity
        self.shm = shared_memory.SharedMemory(create=True, size=HEADER + capacity)
        self.name = self.shm.name
        buf = self.shm.buf
        assert buf is not None
        self.buf: memoryview | None = buf
        _HEAD.pack_into(buf, 0, MAGIC, capacity, 0)
        self.pos = 0  # next byte to write
        self.acked = 0  # every byte before this the reader has consumed
        self._unlinked = False

    def max_record(self) -> int:
        """A record (header included) is at most a quarter of the ring: with half the ring free, one
        always fits, even behind the pad that skips to offset 0."""
        return self.capacity // 4

    def free(self) -> int:
        return self.capacity - (self.pos - self.acked)

    def ack(self, pos: int) -> None:
        if self.acked <= pos <= self.pos:
            self.acked = pos

    def write(self, kind: int, body: bytes) -> int:
        """Append one record; returns the new write position (the reader's wake-up value)."""
        buf = self.buf
        if buf is None:
            raise ValueError(f"ring {self.name}: closed")
        need = _REC.size + len(body)
        need += -need % 8  # records start 8-aligned
        if need > self.max_record():
            raise ValueError(f"record: {len(body)} bytes is more than a quarter of the ring ({self.capacity})")
        off = self.pos % self.capacity
        tail = self.capacity - off
        skip = tail if tail < need else 0
        if skip + need > self.free():
            raise RingFull(f"ring {self.name}: {skip + need} bytes wanted, {self.free()} free")
        if skip:
            if skip >= _REC.size:
                _REC.pack_into(buf, HEADER + off, skip - _REC.size, KIND_PAD)
            self.pos += skip
            off = 0
        _REC.pack_into(buf, HEADER + off, len(body), kind)
        start = HEADER + off + _REC.size
        buf[start:start + len(body)] = body
        self.pos += need
        _POS.pack_into(buf, 16, self.pos)  # published last: the record is whole before it counts
        return self.pos

    def unlink(self) -> None:
        """Remove the name (both ends keep their maps): once the reader has mapped it, nothing is
        left in /dev/shm if either process is SIGKILLed later."""
        if not self._unlinked:
            self._unlinked = True
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        self.buf = None  # the memoryview must go before the map closes
        self.shm.close()


class RingReader:
    """A GPU process's end: maps the writer's segment read-only and walks it by offsets."""

    def __init__(self, name: str) -> None:
        fd = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        magic, self.capacity, _ = _HEAD.unpack_from(self.map, 0)
        if magic != MAGIC or HEADER + self.capacity > size:
            self.map.close()
            raise ValueError(f"ring {name}: not a conductor ring")
        self.pos = 0

    def published(self) -> int:
        got: int = _POS.unpack_from(self.map, 16)[0]
        return got

    def read(self) -> list[tuple[int, bytes]]:
        """Every whole record written since the last call, as (kind, body); pads are skipped."""
        end = self.published()
        out: list[tuple[int, bytes]] = []
        while self.pos < end:
            off = self.pos % self.capacity
            tail = self.capacity - off
            if tail < _REC.size:
                self.pos += tail
                continue
            length, kind = _REC.unpack_from(self.map, HEADER + off)
            size = _REC.size + length
            size += -size % 8
            if kind != KIND_PAD:
                start = HEADER + off + _REC.size
                out.append((kind, bytes(self.map[start:start + length])))
            self.pos += size
        return out

    def close(self) -> None:
        self.map.close()
