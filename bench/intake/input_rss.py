"""Peak memory (RSS) of ``conductor submit`` for a large generated file, JSONL against Parquet.

Generates ``--rows`` native items (prompts of ``--prompt-bytes``), submits each file to a fresh
embedded redis-server with ``conductor submit`` as a child process of a small launcher, which
reads its peak RSS from wait4(). ``--old-tree DIR`` also runs a source tree of an earlier commit (``git archive
REV | tar -x -C DIR``) on the JSONL file, for the figure before streaming input.

    .venv/bin/python -m bench.intake.input_rss --rows 200000 --old-tree /tmp/cdr-old
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from bench.common.report import command_line, git_rev, machine, now_utc, table, write_section  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def rows(n: int, prompt_bytes: int, start: int = 0) -> list[dict]:
    pad = "x" * prompt_bytes
    return [{"id": f"r{i}", "model": "m", "prefix": ["system prompt", f"task {i % 16}"], "prompt": f"{i} {pad}",
             "input_tokens": 64 + i % 512, "max_tokens": 16} for i in range(start, start + n)]


def write_files(d: Path, n: int, prompt_bytes: int) -> tuple[Path, Path]:
    jl, pqf = d / "in.jsonl", d / "in.parquet"
    writer = None
    with open(jl, "w") as f:
        for s in range(0, n, 10_000):
            part = rows(min(10_000, n - s), prompt_bytes, s)
            f.write("".join(json.dumps(r) + "\n" for r in part))
            t = pa.Table.from_pylist(part)
            writer = writer or pq.ParquetWriter(pqf, t.schema)
            writer.write_table(t)
    assert writer is not None
    writer.close()
    return jl, pqf


# A small launcher process runs the submit and reports its peak RSS: a child forked from this
# process would start with this process's pages (the generated rows) in its high-water mark.
_LAUNCH = ("import os, subprocess, sys\n"
           "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
           "_, status, usage = os.wait4(p.pid, 0)\n"
           "print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))\n")


def submit_rss(path: Path, env: dict[str, str], cwd: Path) -> tuple[float, int, float]:
    """(peak RSS MiB, exit status, seconds) of one ``conductor submit``."""
    with EmbeddedRedis() as server:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", _LAUNCH, sys.executable, "-m", "conductor", "--redis", server.url,
                              "submit", str(path), "--job", "j", "--quiet", "--create"], env=env, cwd=str(cwd),
                             capture_output=True, text=True, check=True).stdout.split()
        return int(out[0]) / 1024, int(out[1]), time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[200_000])
    ap.add_argument("--prompt-bytes", type=int, default=500)
    ap.add_argument("--old-tree", help="source tree of an earlier commit, run on the JSONL file too")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    out = []
    for n in a.rows:
        with tempfile.TemporaryDirectory() as d:
            jl, pqf = write_files(Path(d), n, a.prompt_bytes)
            env = dict(os.environ)
            runs = [("JSONL", jl, env, ROOT, "this tree"), ("Parquet", pqf, env, ROOT, "this tree")]
            if a.old_tree:
                # python -m puts the working directory first on sys.path: the old tree's package wins
                runs.insert(0, ("JSONL", jl, env, Path(a.old_tree), "before streaming (commit 9954f5d)"))
            for fmt, path, e, cwd, code in runs:
                mib, rc, dt = submit_rss(path, e, cwd)
                assert rc == 0, f"submit of {path} exited {rc}"
                out.append((f"{n:,}", fmt, code, f"{path.stat().st_size / 2**20:.0f}", f"{mib:.0f}", f"{dt:.1f}",
                            f"{n / dt:,.0f}"))
                print(out[-1], flush=True)
    body = (f"## Input files: peak RSS of `conductor submit` (issue 18)\n\n{now_utc()}, commit {git_rev()}, "
            f"{machine()}.\n\n`{command_line()}`\n\nNative rows, prompts of {a.prompt_bytes} bytes; "
            "each submit to a fresh embedded redis-server; peak RSS of the submit process from wait4() in a "
            "small launcher process.\n\n"
            + table(["rows", "format", "code", "file MiB", "peak RSS MiB", "seconds", "items/s"], out)
            + "\n\nThe file is read in passes (check, then send in chunks of 20,000 items or 4 MiB): memory "
              "holds the items the check keeps for the send pass (up to 32 MiB of lines and bodies, issue 25), "
              "two chunks and an 8-byte digest per id, not the file.\n")
    if not a.no_write:
        write_section("input-rss", body)
    print(body)


if __name__ == "__main__":
    main()
