"""One progress line for long CLI commands: done/total, rate and ETA.

On a terminal it is one live line (rich) redrawn in place; otherwise (a log file, a pipe, a CI
job) a plain line every ``CONDUCTOR_PROGRESS_S`` seconds (default 5), so logs get a trace
without a line per item or terminal control codes.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import IO, Any

PLAIN_EVERY_S = 5.0
_WINDOW_S = 10.0  # the rate is measured over this much recent time: a stall shows as a falling rate
# An ETA needs this much measured progress: one early item after a slow start (workers loading)
# would otherwise promise a day ("ETA 27:39:58") for a job of minutes.
_ETA_MIN_S = 1.0
_ETA_MIN_DONE = 2


def plain_every_s() -> float:
    try:
        return max(0.0, float(os.environ.get("CONDUCTOR_PROGRESS_S", PLAIN_EVERY_S)))
    except ValueError:
        return PLAIN_EVERY_S


def fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA -"
    s = int(round(seconds))
    return f"ETA {s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Rate:
    """Items per second over the last ``_WINDOW_S`` seconds of (time, done) samples."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()
        self._moved = False

    def add(self, done: int, now: float) -> None:
        # Time before the first progress (workers starting, a queue ahead) is no measure of the
        # pace: the window starts when something first moved.
        if not self._moved and self._samples:
            self._moved = done != self._samples[0][1]
            self._samples.clear()
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= _WINDOW_S:
            self._samples.popleft()

    def per_s(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None

    def eta_s(self, done: int, total: int) -> float | None:
        if done >= total:
            return 0.0
        if len(self._samples) < 2:
            return None
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        if t1 - t0 < _ETA_MIN_S or d1 - d0 < _ETA_MIN_DONE:
            return None
        rate = self.per_s()
        return (total - done) / rate if rate else None


class ProgressLine:
    """``update(done, total)`` as often as convenient; ``close()`` (or the with block) ends the line."""

    def __init__(self, label: str, total: int, stream: IO[str], *, unit: str = "items",
                 live: bool | None = None) -> None:
        self.label, self.total, self.stream, self.unit = label, total, stream, unit
        self.done = 0
        self.note = ""
        self.rate = Rate()
        self.rate.add(0, time.monotonic())
        self.live = stream.isatty() if live is None else live
        self._every = plain_every_s()
        self._next_plain = time.monotonic() + self._every
        self._progress: Any = None
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[unit]} · {task.fields[rate]} · {task.fields[eta]}"
                                                 "{task.fields[note]}"),
                                      console=Console(file=stream), transient=False, refresh_per_second=4)
            self._task = self._progress.add_task(label, total=max(total, 1), unit=unit, rate="-/s", eta="ETA -",
                                                 note="")
            self._progress.start()

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def text(self) -> str:
        rate = self.rate.per_s()
        shown = f"{rate:,.1f}/s" if rate is not None else "-/s"
        note = f", {self.note}" if self.note else ""
        return (f"{self.label}: {self.done}/{self.total} {self.unit}, {shown}, "
                f"{fmt_eta(self.rate.eta_s(self.done, self.total))}{note}")

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        now = time.monotonic()
        self.done = done
        self.note = note
        if total is not None:
            self.total = total
        self.rate.add(done, now)
        if self._progress is not None:
            rate = self.rate.per_s()
            self._progress.update(self._task, completed=done, total=max(self.total, 1),
                                  rate=f"{rate:,.1f}/s" if rate is not None else "-/s",
                                  eta=fmt_eta(self.rate.eta_s(done, self.total)), note=f" · {note}" if note else "")
        elif now >= self._next_plain:
            self._next_plain = now + self._every
            self._plain()

    def _plain(self) -> None:
        self.stream.write(self.text() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
