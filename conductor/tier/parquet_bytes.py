"""Parquet to and from bytes without pyarrow's thread pools.

``pq.read_table`` reads through the dataset API, which starts pyarrow's CPU and IO thread pools;
those C++ threads outlive the call, and when one is still winding down as the interpreter
finalizes, a ``std::thread`` is destroyed joinable and the process dies by SIGABRT ("terminate
called without an active exception") after its work is done (issue 27; apache/arrow#34314).
``ParquetFile(...).read(use_threads=False)`` over an in-memory buffer starts no thread at all,
and a store's segments are small enough that one thread is no loss.
"""

from __future__ import annotations

from typing import Any


def table_bytes(columns: dict[str, Any], metadata: dict[bytes, bytes]) -> bytes:
    """A zstd-compressed Parquet file of ``columns`` (name -> pyarrow array) with schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.table(columns).replace_schema_metadata(metadata)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return bytes(sink.getvalue())


def read_bytes(data: bytes) -> Any:
    """The pyarrow Table held in ``data``, read on the calling thread only."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    return pq.ParquetFile(pa.BufferReader(data), pre_buffer=False).read(use_threads=False)
