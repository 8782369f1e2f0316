"""The one intake path of a whole file, in bounded memory: ``conductor submit``, ``conductor run``
and the Batch API (conductor/api/batches.py) all go through these steps.

Three steps, each a pass over the file (``conductor/intake/input_files.py``), so that memory holds
a few chunks of items at a time whatever the file size:

1. validate every line and count the items per model, building only the first chunk's items
   (nothing is sent; a refused line refuses the file unless ``--skip-invalid``);
2. ask Redis what submit would refuse (a paused model; for a job that exists already, ids it has
   with other content or under another model), then record the per-model counts
   (``Conductor.declare``): a refused file leaves nothing behind;
3. send the items in chunks of SEND_CHUNK items or SEND_CHUNK_BYTES (``Conductor.submit``; each
   submit.lua call refuses, atomically, what another producer wrote meanwhile), the next chunk
   built while Redis runs the last, then seal each model.

Every check and read that can fail comes before the first write (the declaration of step 2).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from conductor.client import Conductor
from conductor.client.submit_stream import SubmitReport
from conductor.errors import ConductorError, DuplicateId, NoSuchModel, did_you_mean
from conductor.formats.items import Facts
from conductor.formats.openai_input import MaxTokensDefault
from conductor.intake.input_files import FileScan, LineCheck, Writer, scan
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import JobClass, PreparedItem

# Items per Conductor.submit, and at most about SEND_CHUNK_BYTES of bodies (memory holds two chunks
# read ahead): each call groups its items by shape (conductor/client/submit_stream.py), and a chunk
# of 5,000 items of 20 shapes cost submit.lua 15-30 % more server time per item than one of 20,000
# (its calls touch more lanes; bench/RESULTS.md, intake speed). The cursor moves once per chunk.
SEND_CHUNK = 20_000
SEND_CHUNK_BYTES = 4 * 1024 * 1024
# The check pass builds the items of a file's first chunk (FIRST_CHUNK items, at most about
# SEND_CHUNK_BYTES of bodies) and only checks the other lines, at a third of a build's time; the send
# pass sends that chunk at once and builds each next chunk, at most twice the one before, while
# Redis runs the one before (bench/RESULTS.md, intake speed): every line is still checked before
# the first write, and Redis idles only through the check.
FIRST_CHUNK = 4000
LARGE_SUBMIT = 10_000  # items from which a submit on a terminal shows its live line


@dataclass
class FileSubmit:
    scan: FileScan
    accepted: int = 0
    duplicates: int = 0


# ``input_files.scan`` for a file about to be sent: the first chunk's items kept as built.
scan_to_send = functools.partial(scan, keep_items=FIRST_CHUNK, keep_bytes=2 * SEND_CHUNK_BYTES)


class KnownModels:
    """A line check (input_files.LineCheck): a line naming a model Redis does not know is refused, with
    a did-you-mean, so a typo never waits forever for a worker nor becomes a known model (issue 37).
    ``models()`` is asked once, at the first line (a submit connects only once a line needs it);
    ``field`` names the line's model field in the refusal, ``advice`` says how to make one."""

    def __init__(self, models: Callable[[], list[str]], field: str = "model",
                 advice: str = "--create makes it", unknown: str = "is unknown to this Redis",
                 listed: str = "known") -> None:
        self._models, self.field, self.advice = models, field, advice
        self._is_unknown, self._listed = unknown, listed
        self._known: set[str] | None = None
        self._said: dict[str, str] = {}

    def unknown(self, model: str) -> str:
        """'' for a known model, else why it is refused."""
        if self._known is None:
            self._known = set(self._models())
        if model in self._known:
            return ""
        if model not in self._said:
            known = sorted(self._known)
            shown = f"{self._listed}: {', '.join(known[:10])}" if known else f"none {self._listed} yet"
            self._said[model] = (f"{model!r} {self._is_unknown}{did_you_mean(model, known)} "
                                 f"({shown}{'; ' + self.advice if self.advice else ''})")
        return self._said[model]

    def __call__(self, n: int, line: Facts) -> None:
        why = self.unknown(line.model)
        if why:
            raise NoSuchModel(self.field, why, n)


def check_file(path: str, *, skip_invalid: bool, rejects: str | Writer | None,
               default_max_tokens: MaxTokensDefault | None = None, check: LineCheck | None = None) -> FileScan:
    """Step 1; prints the first refusals on stderr and raises unless ``skip_invalid``.
    ``default_max_tokens(model)``: the output cap of an OpenAI line without one (each pass the same);
    ``check``: a further check of each valid line (KnownModels)."""
    found = scan_to_send(path, rejects=rejects, default_max_tokens=default_max_tokens, check=check)
    if found.refused:
        for e in found.errors:
            print(f"conductor: {e}", file=sys.stderr)
        if len(found.refused) > len(found.errors):
            print(f"conductor: ... and {len(found.refused) - len(found.errors)} more", file=sys.stderr)
        if not skip_invalid:
            raise ConductorError(f"{len(found.refused)} invalid line(s) in {path}; nothing submitted "
                                 "(--skip-invalid submits the valid ones)")
    if not found.items:
        raise ConductorError(f"{path} holds no {'valid ' if found.refused else ''}items: no job made")
    return found


class Ahead:
    """The chunks of a checked file, each next one built a slice at a time while Redis runs the
    calls of the one being sent: ``idle`` is what the submit stream calls before it waits on a
    reply (conductor/client/submit_stream.py). One thread does both, so building never makes the
    sending wait for the GIL (a reader thread of its own cost the send a third of its speed).

    The check's kept items go first, in chunks of their own (sent at once); each chunk after is at
    most twice the one before, which ``idle`` can build while that one is sent (building an item
    costs about a quarter of its submit.lua time). An error of the file's pass (a line that no
    longer checks) is raised by the iteration, never inside the stream."""

    BUILD_PER_WAIT = 2000  # items built per reply waited on (a call carries SUBMIT_CHUNK = 1,000)

    def __init__(self, found: FileScan, size: int, after: int = 0, max_bytes: int = SEND_CHUNK_BYTES) -> None:
        self._sources = found.sources(after)
        self._source = 0
        self._size, self._max_bytes = size, max_bytes
        self._cap = size
        self._next: list[tuple[int, PreparedItem]] = []
        self._held = 0
        self._boundary = False  # the kept items ended: the chunk ends with them
        self._error: BaseException | None = None

    @property
    def _ended(self) -> bool:
        return self._source == len(self._sources)

    def _complete(self) -> bool:
        return len(self._next) >= self._cap or self._held >= self._max_bytes or self._boundary or self._ended

    def idle(self, budget: int = BUILD_PER_WAIT) -> None:
        """Build up to ``budget`` more items of the next chunk (never raises: an error waits for
        the iteration)."""
        while budget > 0 and not self._complete():
            try:
                x = next(self._sources[self._source], None)
            except Exception as e:  # noqa: BLE001 - raised by __iter__, outside the stream
                self._error, self._source = e, len(self._sources)
                return
            if x is None:
                self._source += 1
                self._boundary = bool(self._next)
                continue
            self._next.append(x)
            self._held += len(x[1].body) + len(x[1].id)
            budget -= 1

    def __iter__(self) -> Iterator[list[tuple[int, PreparedItem]]]:
        while True:
            while not self._complete():
                self.idle(self._size)
            if self._error is not None:
                raise self._error
            if not self._next:
                return
            chunk, self._next, self._held, self._boundary = self._next, [], 0, False
            self._cap = min(self._size, 2 * len(chunk))
            yield chunk


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
               progress: Callable[[int], None] | None = None, idle: Callable[[], None] | None = None) -> SubmitReport:
    """One chunk of a checked file (its lines numbered) into the job, whose refusals ``prepare_job``
    asked for the whole file before its first write; a refused id names its line. ``idle``: work to
    do while a reply is awaited (``Ahead.idle``)."""
    try:
        return c.submit([it for _, it in chunk], job, progress=progress, checked=True, idle=idle)
    except DuplicateId as e:
        raise _with_line(e, chunk) from None


def send_file(c: Conductor, found: FileScan, job: str, *, progress: Callable[[int], None] | None = None,
              seal: bool = True, should_stop: Callable[[], bool] | None = None) -> FileSubmit:
    """Step 3. ``progress(done)`` after every submit call; ``should_stop()`` is asked before each
    chunk (a batch cancelled while it is submitted stops there: the models are sealed all the same)."""
    out = FileSubmit(found)
    done = 0
    ahead = Ahead(found, SEND_CHUNK)
    for chunk in ahead:
        if should_stop is not None and should_stop():
            break
        rep = send_chunk(c, chunk, job, progress=None if progress is None else shifted(progress, done),
                         idle=ahead.idle)
        out.accepted += rep.accepted
        out.duplicates += rep.duplicates
        done += len(chunk)
    if seal:
        for model in sorted(found.counts):
            c.seal(model)
    return out


def shifted(progress: Callable[[int], None], base: int) -> Callable[[int], None]:
    return lambda k: progress(base + k)
