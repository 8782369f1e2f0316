"""Where commands write: never over their own input, never a truncated file that looks finished,
and every write error one line naming the path.

A regular file (or a path that does not exist yet) is written under a temporary name in its own
folder and renamed into place when complete (``commit``): a reader of the path sees the old file
or the whole new one, and an interrupted command leaves the old file as it was. A device, pipe or
terminal (``/dev/stdout``, a FIFO, ``/dev/full``) is written directly: it cannot be renamed onto.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from typing import IO

from conductor.errors import ConductorError


class OutputError(ConductorError):
    """A write that failed (a full disk, a read-only folder, a closed pipe), naming the path."""

    def __init__(self, path: str, err: OSError) -> None:
        self.path = path
        super().__init__(f"cannot write {path}: {err.strerror or err}")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def refuse_overwrite(inputs: list[str], outputs: dict[str, str | None]) -> None:
    """Refuses an output that is one of the inputs (also through a symlink or a hard link: the same
    device and inode) or another output, before anything is opened for writing."""
    seen: dict[tuple[int, int], str] = {}
    for path in inputs:
        ident = _identity(path)
        if ident is not None:
            seen[ident] = f"the input file {path}"
    for flag, out in outputs.items():
        ident = _identity(out) if out else None
        if ident is None:
            continue
        what = seen.get(ident)
        if what is not None and stat.S_ISREG(os.stat(str(out)).st_mode):
            raise ConductorError(f"{flag} {out} is {what}: refusing to write over it (name another file)")
        seen[ident] = f"the file of another option ({flag})"


def beside(path: str) -> str:
    """A free name next to ``path`` for a part of it: ``out.partial.jsonl``, else ``out.partial-2.jsonl``, ..."""
    folder, name = os.path.split(path)
    stem, dot, ext = name.rpartition(".")
    if not stem:  # no extension (or a dot file): the tag goes last
        stem, dot, ext = name, "", ""
    for k in range(1, 10_000):
        tag = "partial" if k == 1 else f"partial-{k}"
        candidate = os.path.join(folder, f"{stem}.{tag}{dot}{ext}")
        if not os.path.lexists(candidate):
            return candidate
    raise ConductorError(f"no free name beside {path} for the partial output: remove old {stem}.partial* files")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Output:
    """A binary output at ``path`` (``-`` or None: standard output)."""

    def __init__(self, path: str | None) -> None:
        self.path = path or "-"
        self.name = "standard output" if self.path == "-" else self.path
        self._tmp: str | None = None
        self.f: IO[bytes]
        try:
            if self.path == "-":
                self.f = sys.stdout.buffer
                return
            try:
                st: os.stat_result | None = os.stat(self.path)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(21, "Is a directory", self.path)
            if st is not None and not stat.S_ISREG(st.st_mode):
                self.f = open(self.path, "wb")  # noqa: SIM115 - closed by commit/discard
                return
            folder = os.path.dirname(os.path.abspath(self.path))
            fd, self._tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.", suffix=".part", dir=folder)
            # mkstemp makes the file 0600; the finished file gets what open() would have given it
            os.fchmod(fd, stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask())
            self.f = os.fdopen(fd, "wb")
        except IsADirectoryError:
            raise
        except OSError as e:
            raise OutputError(self.name, e) from None

    def write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except BrokenPipeError:
            if self.path == "-":
                raise  # `conductor results J | head`: the reader went away (exit 141, quietly)
            raise OutputError(self.name, BrokenPipeError(32, "the reader went away")) from None
        except OSError as e:
            raise OutputError(self.name, e) from None

    def flush(self) -> None:
        try:
            self.f.flush()
        except BrokenPipeError:
            if self.path == "-":
                raise
            raise OutputError(self.name, BrokenPipeError(32, "the reader went away")) from None
        except OSError as e:
            raise OutputError(self.name, e) from None

    def commit(self, to: str | None = None) -> None:
        """Flush and close, then move the finished file into place (at ``to`` instead of the path:
        an interrupted run's part, beside an earlier complete output it must not replace)."""
        self.flush()
        if self.path == "-":
            return
        try:
            self.f.close()
            if self._tmp is not None:
                os.replace(self._tmp, to or self.path)
                self._tmp = None
        except OSError as e:
            self.discard()
            raise OutputError(self.name, e) from None

    def discard(self) -> None:
        """Leave the path as it was (nothing of this output is kept)."""
        if self.path == "-":
            return
        try:
            self.f.close()
        except OSError:
            pass  # a failed flush of what is being thrown away
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            self._tmp = None

    def __enter__(self) -> Output:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()
