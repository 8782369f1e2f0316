"""Shared bits of the benchmarks: machine description, percentiles, RESULTS.md sections."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import redis

RESULTS = Path(__file__).resolve().parents[1] / "RESULTS.md"
HEADER = ("# Benchmark results\n\nEach section below is rewritten by the command it names; "
          "numbers come from one run on the machine it names.\n")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(r: redis.Redis | None = None) -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    parts = [f"nproc {os.cpu_count()}", cpu_model(), f"load average {load} at the start",
             f"Python {platform.python_version()}"]
    if r is not None:
        parts.append(f"Redis {r.info('server')['redis_version']}")
    try:
        import redis as _redis
        parts.append(f"redis-py {_redis.__version__}")
    except Exception:  # noqa: BLE001 - informational only
        pass
    return ", ".join(parts)


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv])


def now_utc() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=RESULTS.parent, timeout=5).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def median(values: Sequence[float]) -> float:
    return pct(values, 50)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def publish(text: str, section: str, *, write: bool = True, json_path: str | None = None,
            data: object = None) -> None:
    """A benchmark's end: its report printed, what it measured as JSON where asked (``json_path``),
    and its section of bench/RESULTS.md rewritten unless ``write`` is False."""
    print()
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(data, indent=1, default=str))
    if write:
        write_section(section, text)
        print(f"\nwrote bench/RESULTS.md (section {section})")


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) the section between this name's markers; other sections stay."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = path.read_text() if path.exists() else HEADER
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _m: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
