"""The store of the disk tier: a directory or any fsspec URL (``s3://bucket/prefix`` with s3fs,
``memory://x`` in tests), given by ``--store URL`` or ``CONDUCTOR_STORE``.

It holds files by name and knows nothing of Redis: ``conductor/tier/segments.py`` decides what goes in
them, ``conductor/tier/spill.py`` when. A write is whole or absent: on a local directory the file is
written under a temporary name and renamed; object stores put an object whole.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any

from conductor.errors import ConductorError

ENV = "CONDUCTOR_STORE"


class StoreError(ConductorError):
    """The store refused or failed a read or a write."""


class Store:
    def __init__(self, url: str) -> None:
        import fsspec
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise StoreError(f"store {url}: {e}") from None
        self.local = "file" in _protocols(self.fs)

    def check_writable(self) -> None:
        """Write and remove a probe file: a store that refuses writes is found before the first
        item is sent, so nothing is half-submitted."""
        name = f"probe/{uuid.uuid4().hex}"
        self.put(name, b"conductor store probe\n")
        self.delete(name)

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def put(self, name: str, data: bytes) -> None:
        path = self.path(name)
        try:
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            if self.local:
                tmp = f"{path}.{uuid.uuid4().hex}.tmp"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except Exception as e:  # noqa: BLE001 - an object store's client raises its own types (botocore's)
            raise StoreError(f"store {self.url}: cannot write {name}: {e}") from None

    def get(self, name: str) -> bytes:
        try:
            data: bytes = self.fs.cat_file(self.path(name))
            return data
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - an object store's client raises its own types (botocore's)
            raise StoreError(f"store {self.url}: cannot read {name}: {e}") from None

    def exists(self, name: str) -> bool:
        try:
            return bool(self.fs.exists(self.path(name)))
        except Exception as e:  # noqa: BLE001 - an object store's client raises its own types (botocore's)
            raise StoreError(f"store {self.url}: cannot look up {name}: {e}") from None

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - an object store's client raises its own types (botocore's)
            raise StoreError(f"store {self.url}: cannot delete {name}: {e}") from None


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def store_from(url: str | None) -> Store | None:
    """The store named by ``url``, else by CONDUCTOR_STORE, else none (the tier is off)."""
    url = url or os.environ.get(ENV) or None
    return Store(url) if url else None
