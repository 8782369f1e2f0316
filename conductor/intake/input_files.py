"""Input files (JSONL and Parquet) read as a stream of validated items, in bounded memory.

A file is read more than once instead of being held: a first pass validates every line (or row)
and counts the items per model, a second sends them (``conductor/intake/file_intake.py``); both
read it with conductor/formats/file_lines.py. Only the line numbers of refused lines, an 8-byte
digest per item id (for the duplicate check: one id, one item of a job, sorted once) and the
items of the first chunk are kept: the check pass builds those and only checks the rest
(``conductor.formats.lines.line_facts``), which the send pass builds while Redis runs the chunk
before.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from conductor.errors import BadInput, ConductorError
from conductor.formats.file_lines import iter_checked, iter_lines
from conductor.formats.items import Facts
from conductor.formats.lines import facts_of
from conductor.formats.openai_input import MaxTokensDefault
from conductor.redis_contract.records import PreparedItem


def _id_digest(item_id: str) -> int:
    # xxh64: a tenth of blake2b's time per id; a repeated digest only sends its lines to an exact look
    return xxhash.xxh64_intdigest(item_id.encode())


class Writer(Protocol):
    """Where refused lines go when the caller opens the file itself (the CLI writes it under a
    temporary name and names the path in a write error: conductor/cli/output.py)."""

    def write(self, data: bytes, /) -> Any: ...


# A check of one valid line beyond its format (the Batch API's: an OpenAI request for its endpoint),
# given the line number and what the check pass knows of it: raises BadInput to refuse the line.
LineCheck = Callable[[int, Facts], None]


@dataclass
class FileScan:
    """What the first pass learnt: valid items per model and the numbers of refused lines."""

    path: str
    counts: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    refused: set[int] = field(default_factory=set)
    refusals: list[BadInput] = field(default_factory=list)  # the first few, to show (each names line and field)
    # the output cap of an OpenAI line without one, the same in every pass (conductor.formats.lines.parse_line)
    default_max_tokens: MaxTokensDefault | None = None
    parquet: bool = True  # read the same way in every pass (iter_lines)
    # The first valid items as the check built them (scan's keep_items, keep_bytes of their lines):
    # the send pass sends these first, while it builds the next chunk (kept_to: the last line kept).
    kept: list[tuple[int, PreparedItem]] = field(default_factory=list)
    kept_to: int = 0

    @property
    def items(self) -> int:
        return sum(self.counts.values())

    @property
    def errors(self) -> list[str]:
        return [str(e) for e in self.refusals]

    def sources(self, after: int = 0) -> tuple[Iterator[tuple[int, PreparedItem]], Iterator[tuple[int, PreparedItem]]]:
        """The valid items past line ``after``, with their line numbers, from their two sources: the
        kept ones (built by the check), then a lazy pass over the rest of the file (built as read)."""
        kept = ((n, it) for n, it in self.kept if n > after and n not in self.refused)
        rest = valid_items(self.path, self.refused, self.default_max_tokens, parquet=self.parquet,
                           after=max(after, self.kept_to))
        return kept, rest

    def chunks(self, size: int, after: int = 0, max_bytes: int = 0) -> Iterator[list[tuple[int, PreparedItem]]]:
        """The valid items past line ``after``, at most ``size`` at a time (and, with ``max_bytes``,
        about that many bytes of bodies), with their line numbers: the kept ones, then a pass over
        the rest of the file."""
        buf: list[tuple[int, PreparedItem]] = []
        held = 0
        for source in self.sources(after):
            for x in source:
                buf.append(x)
                held += len(x[1].body) + len(x[1].id)
                if len(buf) >= size or (max_bytes and held >= max_bytes):
                    yield buf
                    buf, held = [], 0
        if buf:
            yield buf


SHOWN_ERRORS = 20
NUMPY_FROM = 200_000  # ids from which the duplicate check sorts with numpy (a Python list of ints is ~40 bytes each)


def scan(path: str, *, rejects: str | Writer | None = None, progress: Callable[[int], None] | None = None,  # noqa: C901 - one pass, its refusals recorded as found
         default_max_tokens: MaxTokensDefault | None = None, check: LineCheck | None = None,
         id_field: str = "id", shown: int = SHOWN_ERRORS, parquet: bool = True, keep_items: int = 0,
         keep_bytes: int = 8 * 1024 * 1024) -> FileScan:
    """Validate every line (and ``check`` each valid one), count the valid items per model, and
    refuse duplicate ids (the later lines; ``id_field`` names the field in the refusal). Refusals
    are written to ``rejects`` (JSONL: line, field, error, raw) as found; the first ``shown`` are
    kept in ``refusals``. The first ``keep_items`` valid items are kept as built (while their lines
    and bodies add up to at most ``keep_bytes``; ``FileScan.kept``): the send pass sends them at
    once and builds the rest while Redis runs them; the other lines are only checked."""
    out = FileScan(path, default_max_tokens=default_max_tokens, parquet=parquet)
    kept_bytes = 0
    keeping = [keep_items > 0]  # read by iter_checked as it goes
    digests = array("Q")
    opened = open(rejects, "wb") if isinstance(rejects, str) else None  # noqa: SIM115 - closed below
    rej: Writer | None = opened if opened is not None else rejects if not isinstance(rejects, str) else None
    try:
        def refuse(n: int, e: BadInput, raw: bytes) -> None:
            out.refused.add(n)
            if len(out.refusals) < shown:
                out.refusals.append(e)
            if rej:
                rej.write(json.dumps({"line": n, "field": e.field, "error": str(e),
                                      "raw": raw.decode("utf-8", "replace")}).encode() + b"\n")

        k = 0
        for n, it, raw in iter_checked(path, default_max_tokens, parquet=parquet, build=lambda: keeping[0]):
            if isinstance(it, BadInput):
                refuse(n, it, raw)
                continue
            if check is not None:
                try:
                    check(n, it if isinstance(it, Facts) else facts_of(it))
                except BadInput as e:
                    refuse(n, e, raw)
                    continue
            digests.append(_id_digest(it.id))
            if keeping[0] and isinstance(it, PreparedItem):
                # the line read (a Parquet row has none: its body stands for it), and the body built from it
                kept_bytes += (len(raw) or len(it.body)) + len(it.body)
                if kept_bytes <= keep_bytes and len(out.kept) < keep_items:
                    out.kept.append((n, it))
                    out.kept_to = n
                else:
                    keeping[0] = False
            out.counts[it.model] = out.counts.get(it.model, 0) + 1
            out.tokens += it.input_tokens
            k += 1
            if progress and k % 10_000 == 0:
                progress(k)
        dups = _repeated(digests)
        del digests
        if dups:
            # A second look at the few lines whose id digest repeats: the later ones are refused.
            first: dict[str, tuple[int, str]] = {}
            for n, it, raw in iter_lines(path, default_max_tokens, parquet=parquet):
                if isinstance(it, BadInput) or n in out.refused or _id_digest(it.id) not in dups:
                    continue
                at, model = first.setdefault(it.id, (n, it.model))
                if at != n:
                    across = f" (there for model {model}: an id names one item of a job, across its models)" \
                        if model != it.model else ""
                    refuse(n, BadInput(id_field, f"duplicate of line {at}{across}", n), raw)
                    out.counts[it.model] -= 1
                    out.tokens -= it.input_tokens
    finally:
        if opened is not None:
            opened.close()
    out.counts = {m: c for m, c in out.counts.items() if c > 0}
    return out


def _repeated(digests: array[int]) -> set[int]:
    """The digests that occur more than once (a sorted copy: 8 bytes per id)."""
    if len(digests) < 2:
        return set()
    if len(digests) <= NUMPY_FROM:
        # numpy's import alone costs about 0.1 s, a quarter of a small submit's whole run
        s = sorted(digests)
        return {a for a, b in zip(s, s[1:], strict=False) if a == b}
    import numpy as np
    a = np.frombuffer(digests, dtype=np.uint64).copy()
    a.sort()
    same = a[1:] == a[:-1]
    return {int(v) for v in a[1:][same]}


def valid_items(path: str, refused: set[int], default_max_tokens: MaxTokensDefault | None = None, *,
                parquet: bool = True, after: int = 0) -> Iterator[tuple[int, PreparedItem]]:
    """The valid items of a scanned file past line ``after``, with their line numbers, built as read."""
    for n, it, _ in iter_lines(path, default_max_tokens, parquet=parquet, after=after):
        if n in refused:
            continue
        if isinstance(it, BadInput):
            # the check pass accepted it: the file changed since (or the two passes disagree), and
            # sending the rest would leave this line without an answer
            raise ConductorError(f"line {n} of {path} was valid when checked and is not now ({it}): "
                                 "the file changed during its intake; nothing more sent")
        yield n, it
