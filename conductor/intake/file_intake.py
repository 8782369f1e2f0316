"""The one intake path of a whole file, in bounded memory: ``conductor submit``, ``conductor run``
and the Batch API (conductor/api/batches.py) all go through these steps.

Three steps, each a pass over the file (``conductor/intake/input_files.py``), so that memory holds
one chunk of items at a time whatever the file size:

1. validate every line and count the items per model (nothing is sent; a refused line refuses
   the file unless ``--skip-invalid``);
2. ask Redis what submit would refuse (a paused model; for a job that exists already, ids it has
   with other content or under another model), then record the per-model counts
   (``Conductor.declare``): a refused file leaves nothing behind;
3. send the items in chunks of SEND_CHUNK items or SEND_CHUNK_BYTES (``Conductor.submit``, which asks again per chunk:
   another producer may have written meanwhile), then seal each model.

Every check and read that can fail comes before the first write (the declaration of step 2).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from conductor.client import Conductor
from conductor.client.submit_stream import SubmitReport
from conductor.errors import ConductorError, DuplicateId
from conductor.intake.formats import MaxTokensDefault
from conductor.intake.input_files import FileScan, Writer, scan
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import JobClass, PreparedItem

# Items per Conductor.submit, and at most about SEND_CHUNK_BYTES of bodies (memory holds two chunks
# read ahead): each call groups its items by shape (conductor/client/submit_stream.py), and a chunk
# of 5,000 items of 20 shapes cost submit.lua 15-30 % more server time per item than one of 20,000
# (its calls touch more lanes; bench/RESULTS.md, intake speed). The cursor moves once per chunk.
SEND_CHUNK = 20_000
SEND_CHUNK_BYTES = 4 * 1024 * 1024
# The first items of a file are kept as the check built them, up to this many bytes of lines and
# bodies: the send pass then parses only the rest (a parse costs about what the send costs;
# bench/RESULTS.md, intake speed). Memory grows by about that much for a file of that size or more.
KEEP_BYTES = 32 * 1024 * 1024
LARGE_SUBMIT = 10_000  # items from which a submit on a terminal shows its live line


@dataclass
class FileSubmit:
    scan: FileScan
    accepted: int = 0
    duplicates: int = 0


def check_file(path: str, *, skip_invalid: bool, rejects: str | Writer | None,
               default_max_tokens: MaxTokensDefault | None = None) -> FileScan:
    """Step 1; prints the first refusals on stderr and raises unless ``skip_invalid``.
    ``default_max_tokens(model)``: the output cap of an OpenAI line without one (each pass the same)."""
    found = scan(path, rejects=rejects, default_max_tokens=default_max_tokens, keep_bytes=KEEP_BYTES)
    if found.refused:
        for e in found.errors:
            print(f"error: {e}", file=sys.stderr)
        if len(found.refused) > len(found.errors):
            print(f"error: ... and {len(found.refused) - len(found.errors)} more", file=sys.stderr)
        if not skip_invalid:
            raise ConductorError(f"{len(found.refused)} invalid line(s) in {path}; nothing submitted "
                                 "(--skip-invalid submits the valid ones)")
    if not found.items:
        raise ConductorError(f"{path} holds no {'valid ' if found.refused else ''}items: no job made")
    return found


class Prefetched:
    """The chunks of a checked file, read and parsed one chunk ahead by a thread of their own: the
    parse of chunk k+1 runs while Redis runs chunk k's submit.lua calls (the socket wait releases
    the GIL), instead of after it. At most two chunks are held besides the one being sent.
    A ``with`` block ends the reader however the sending stops."""

    _END = object()

    def __init__(self, found: FileScan, size: int, after: int = 0) -> None:
        self._q: queue.Queue[object] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._chunks = found.chunks(size, after, SEND_CHUNK_BYTES)
        self._thread = threading.Thread(target=self._read, name="intake-read", daemon=True)

    def _put(self, x: object) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(x, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        try:
            for chunk in self._chunks:
                if not self._put(chunk):
                    return
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the sender, raised there
            self._put(e)

    def __enter__(self) -> Iterator[list[tuple[int, PreparedItem]]]:
        self._thread.start()
        return self._iter()

    def _iter(self) -> Iterator[list[tuple[int, PreparedItem]]]:
        while True:
            x = self._q.get()
            if x is self._END:
                return
            if isinstance(x, BaseException):
                raise x
            yield x  # type: ignore[misc]

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _by_model(chunk: list[tuple[int, PreparedItem]]) -> dict[str, list[PreparedItem]]:
    out: dict[str, list[PreparedItem]] = {}
    for _, it in chunk:
        out.setdefault(it.model, []).append(it)
    return out


def _with_line(e: DuplicateId, chunk: list[tuple[int, PreparedItem]]) -> DuplicateId:
    line = next((n for n, it in chunk if it.id == e.item_id), None)
    return DuplicateId(e.item_id, e.detail, line)


def prepare_job(c: Conductor, found: FileScan, job: str, job_class: JobClass | None = None) -> None:
    """Step 2: every refusal Redis would give, asked before the first write, then the job's class
    (its tenant, priority and deadline: which instances take its items) and the declaration, with the
    file's line counts (``input_lines``, ``refused_lines`` in the job's lifecycle hash: conductor status
    and jobs count lines by them where the file is the job's kept input, job_state.line_counts)."""
    exists = c.r.zscore(K.JOBS_KEY, job) is not None
    if exists:
        for chunk in found.chunks(SEND_CHUNK, 0, SEND_CHUNK_BYTES):
            items = [it for _, it in chunk]
            c.check_submit(items, job)
            try:
                c.check_ids_across_models(job, _by_model(chunk))
            except DuplicateId as e:  # the job has the id under another model (an earlier run)
                raise _with_line(e, chunk) from None
    else:
        # A new job has no ids to conflict with: only a paused model would refuse it.
        c.check_paused(list(found.counts))
    if job_class is not None:
        c.set_job_class(job, found.counts, job_class)
    c.declare(job, found.counts)  # ids are distinct in a checked file
    c.r.hset(K.job_meta_key(job), mapping={"input_lines": found.items + len(found.refused),
                                           "refused_lines": len(found.refused)})


def send_chunk(c: Conductor, chunk: list[tuple[int, PreparedItem]], job: str, *,
               progress: Callable[[int], None] | None = None) -> SubmitReport:
    """One chunk of a checked file (its lines numbered) into the job; a refused id names its line."""
    try:
        return c.submit([it for _, it in chunk], job, progress=progress)
    except DuplicateId as e:
        raise _with_line(e, chunk) from None


def send_file(c: Conductor, found: FileScan, job: str, *, progress: Callable[[int], None] | None = None,
              seal: bool = True, should_stop: Callable[[], bool] | None = None) -> FileSubmit:
    """Step 3. ``progress(done)`` after every submit call; ``should_stop()`` is asked before each
    chunk (a batch cancelled while it is submitted stops there: the models are sealed all the same)."""
    out = FileSubmit(found)
    done = 0
    with Prefetched(found, SEND_CHUNK) as chunks:
        for chunk in chunks:
            if should_stop is not None and should_stop():
                break
            rep = send_chunk(c, chunk, job, progress=None if progress is None else shifted(progress, done))
            out.accepted += rep.accepted
            out.duplicates += rep.duplicates
            done += len(chunk)
    if seal:
        for model in sorted(found.counts):
            c.seal(model)
    return out


def shifted(progress: Callable[[int], None], base: int) -> Callable[[int], None]:
    return lambda k: progress(base + k)
