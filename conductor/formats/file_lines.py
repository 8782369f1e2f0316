"""The lines of an input file (JSON lines or Parquet), each as its item or why it is refused, read as
a stream: a file is never held in memory (conductor/intake/input_files.py checks a file in a
first pass and sends it in a second, both reading it here; a job's ledger and its retry read the
kept input here too).

Parquet (pyarrow, read in record batches): either the native columns (``id``, ``model``,
``prefix``, ``prompt``, ``input_tokens``, ``max_tokens``, ``payload``) or the OpenAI batch input
columns (``custom_id``, ``method``, ``url``, ``body``; ``body`` a struct or a JSON string). A
null cell is an absent field. Row numbers stand where JSONL has line numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from conductor.errors import BadInput
from conductor.formats.items import Facts
from conductor.formats.lines import line_facts, parse_line
from conductor.formats.native import NATIVE_FIELDS, from_native
from conductor.formats.openai_input import MaxTokensDefault, from_openai
from conductor.redis_contract.records import PreparedItem

PARQUET_MAGIC = b"PAR1"
PARQUET_BATCH_ROWS = 1024
_OPENAI_COLUMNS = {"custom_id", "method", "url", "body"}


def is_parquet(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == PARQUET_MAGIC


def _drop_nulls(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if v is not None}


def _row_item(row: dict[str, Any], n: int, openai: bool, default_max_tokens: MaxTokensDefault | None) -> PreparedItem:
    row = _drop_nulls(row)
    if openai:
        body = row.get("body")
        if isinstance(body, str | bytes):
            try:
                body = msgspec.json.decode(body)
            except msgspec.DecodeError as e:
                raise BadInput("body", f"not valid JSON ({e})", n) from None
        if isinstance(body, dict):
            # a struct column has every field in every row: the ones this row lacks are null
            body = _drop_nulls(body)
            if isinstance(body.get("messages"), list):
                body["messages"] = [_drop_nulls(m) if isinstance(m, dict) else m for m in body["messages"]]
        row["body"] = body
        return from_openai(row, n, default_max_tokens)
    return from_native(row, n)


def _raw_row(row: dict[str, Any]) -> bytes:
    return json.dumps(row, default=str).encode()


def iter_lines(path: str, default_max_tokens: MaxTokensDefault | None = None, *, parquet: bool = True,
               after: int = 0) -> Iterator[tuple[int, PreparedItem | BadInput, bytes]]:
    """Every non-blank line (or row) of the file: its number, its item or why it is refused, and
    its raw text (for --rejects). ``default_max_tokens(model)``: the output cap of an OpenAI line
    without one (lines.parse_line). ``parquet`` False reads a file as JSON lines whatever its
    first bytes (the Batch API takes JSONL, as OpenAI's does). ``after``: lines up to that number
    are skipped unread (JSONL; a Parquet file's rows are read and dropped)."""
    if parquet and is_parquet(path):
        yield from (x for x in _iter_parquet(path, default_max_tokens) if x[0] > after)
        return
    for n, line in _jsonl(path, after):
        try:
            yield n, parse_line(line, n, default_max_tokens), line
        except BadInput as e:
            yield n, e, line


def _jsonl(path: str, after: int = 0) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of a JSONL file past line ``after``, numbered, without their line end."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n <= after:
                continue
            line = raw.rstrip(b"\r\n")
            if line and not line.isspace():  # isspace copies nothing
                yield n, line


def iter_checked(path: str, default_max_tokens: MaxTokensDefault | None, *, parquet: bool,
                 build: Callable[[], bool]) -> Iterator[tuple[int, PreparedItem | Facts | BadInput, bytes]]:
    """``iter_lines`` for the check pass: a valid line is built into its item while ``build()``
    says so, and only checked after (its ``Facts``). A Parquet row is built either way."""
    if parquet and is_parquet(path):
        yield from _iter_parquet(path, default_max_tokens)
        return
    for n, line in _jsonl(path):
        try:
            yield n, parse_line(line, n, default_max_tokens) if build() else \
                line_facts(line, n, default_max_tokens), line
        except BadInput as e:
            yield n, e, line


def _iter_parquet(path: str, default_max_tokens: MaxTokensDefault | None,
                  ) -> Iterator[tuple[int, PreparedItem | BadInput, bytes]]:
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path, pre_buffer=False)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
        raise BadInput("file", f"not a readable Parquet file ({e})") from None
    cols = set(pf.schema_arrow.names)
    openai = "custom_id" in cols
    allowed = _OPENAI_COLUMNS if openai else NATIVE_FIELDS
    unknown = sorted(cols - allowed)
    if unknown:
        raise BadInput(unknown[0], "unknown column (Parquet columns: " + ", ".join(sorted(allowed)) + ")")
    n = 0
    # one thread: pyarrow's thread pool buffers cost some 30 MB of RSS and reading is not the bottleneck
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, use_threads=False):
        for row in batch.to_pylist():
            n += 1
            try:
                yield n, _row_item(row, n, openai, default_max_tokens), b""
            except BadInput as e:
                yield n, e, _raw_row(row)
