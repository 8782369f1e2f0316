"""Intake speed (issue 25): ``conductor submit`` of a file and the Batch API's intake against the plain
pipelined XADD of the same items, with the library path, side by side on one server.

    .venv/bin/python -m bench.intake.intake_speed                 # full run, rewrites its RESULTS.md section
    .venv/bin/python -m bench.intake.intake_speed --quick         # small sizes, prints only

One private redis-server (EmbeddedRedis), one file of ``--items`` native lines (bench/common/workload.py
make_items: prompts of about 300 bytes, 20 shapes) and the same requests in OpenAI's batch format.
Each repetition runs every system once, in a rotated order, on an emptied server:

* ``xadd``: the native file's items (parsed before the clock starts) in redis-py pipelines of
  1,000 XADDs carrying id, job, signature, token counts and body (bench/broker/submit_claim.py's limit);
* ``library``: ``Conductor.submit`` of the same parsed items;
* ``submit``: ``conductor submit FILE --quiet`` as the CLI runs it (cli/main.py), in this process:
  the file read from disk, every line checked, the job declared, the durable intake task recorded,
  the items sent with a cursor write per chunk;
* ``submit (process)``: the same command as a child process (its interpreter start included);
* ``api``: the Batch API's intake of the OpenAI file (a batch's task run as serve's thread runs it:
  conductor/intake/intake_run.py), against ``xadd (OpenAI)``, the XADD of its own parsed items;
* ``xadd (file)`` and ``xadd (OpenAI file)``: the like-for-like peer of the file paths, a plain
  producer of the same file: each line read and decoded (msgspec, no check) for its id, and XADDed
  with its job and its bytes, in pipelines of 1,000 (the limits above start from parsed items);
* with ``--old-tree DIR`` (``git archive REV | tar -x -C DIR``): ``submit (process, old tree)``, that
  commit's ``conductor submit`` as a child process, for the figure before.

Figures are medians over the repetitions; ratios are paired within a repetition (each system over
the limit measured minutes apart on the same server) and then the median taken.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec  # noqa: E402
import redis  # noqa: E402

from bench.broker.submit_claim import run_xadd  # noqa: E402
from bench.common.report import command_line, git_rev, machine, median, now_utc, publish, table  # noqa: E402
from bench.common.workload import make_items  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.formats.file_lines import iter_lines  # noqa: E402
from conductor.formats.openai_input import CHAT_URL  # noqa: E402
from conductor.intake.intake_run import run as run_task  # noqa: E402
from conductor.intake.intake_task import Task, create  # noqa: E402
from conductor.jobs import job_state  # noqa: E402
from conductor.redis_contract.records import PreparedItem  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("xadd", "library", "submit", "submit (process)", "xadd (OpenAI)", "api", "xadd (file)",
           "xadd (OpenAI file)")
OLD = "submit (process, old tree)"
LIMIT_OF = {"library": "xadd", "submit": "xadd", "submit (process)": "xadd", "api": "xadd (OpenAI)", OLD: "xadd"}
GOALS = {"library": 1.0, "submit": 0.8, "submit (process)": 0.8, "api": 0.8, OLD: 0.8}
# the file paths against a plain producer that reads the same file
FILE_LIMIT_OF = {"submit": "xadd (file)", "submit (process)": "xadd (file)", "api": "xadd (OpenAI file)",
                 OLD: "xadd (file)"}


def write_files(d: Path, n: int) -> tuple[Path, Path]:
    native, openai = d / "native.jsonl", d / "openai.jsonl"
    with open(native, "w") as fn, open(openai, "w") as fo:
        for it in make_items(n, shapes=20, seed=1, tag="s"):
            prompt, _ = json.loads(it.body)
            fn.write(json.dumps({"id": it.id, "model": it.model, "prefix": list(it.prefix), "prompt": prompt,
                                 "input_tokens": it.input_tokens, "max_tokens": it.max_tokens}) + "\n")
            fo.write(json.dumps({"custom_id": it.id, "method": "POST", "url": CHAT_URL, "body": {
                "model": it.model, "max_tokens": it.max_tokens,
                "messages": [{"role": "system", "content": it.prefix[0]}, {"role": "user", "content": prompt}]}})
                     + "\n")
    return native, openai


def run_xadd_file(r: redis.Redis, path: Path, job: str, chunk: int = 1000) -> None:
    """A plain producer of a JSONL file: each line decoded for its id and XADDed as it is."""
    key = "plain:file"
    dec = msgspec.json.Decoder()
    pipe = r.pipeline(transaction=False)
    with open(path, "rb") as f:
        for k, line in enumerate(f, 1):
            obj = dec.decode(line)
            pipe.xadd(key, {"id": obj.get("custom_id") or obj["id"], "job": job, "d": line})
            if k % chunk == 0:
                pipe.execute()
    pipe.execute()


def parsed(path: Path) -> list[PreparedItem]:
    return [it for _, it, _ in iter_lines(str(path)) if isinstance(it, PreparedItem)]


def run_cli_in_process(url: str, path: Path, job: str) -> None:
    from conductor.cli.main import main
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["--redis", url, "submit", str(path), "--job", job, "--quiet", "--create"])
    assert rc == 0, rc


def run_cli_process(url: str, path: Path, job: str, tree: Path = ROOT) -> None:
    # python -m puts the working directory first on sys.path: the tree's package wins
    subprocess.run([sys.executable, "-m", "conductor", "--redis", url, "submit", str(path), "--job", job, "--quiet",
                    "--create"], check=True, cwd=str(tree), stdout=subprocess.DEVNULL, env=dict(os.environ))


def run_api(c: Conductor, path: Path, job: str) -> None:
    job_state.start(c.r, job, status="validating")
    create(c, Task(job=job, source="api", path=str(path.resolve()), file_id="file-bench", endpoint=CHAT_URL), "bench")
    out = run_task(c, job, "bench")
    assert out.state == "done", out


def bench(url: str, r: redis.Redis, native: Path, openai: Path, reps: int,
          log: Callable[[str], None] = print, old_tree: Path | None = None) -> dict[str, list[float]]:
    items, oitems = parsed(native), parsed(openai)
    n = len(items)
    runs: dict[str, Callable[[str], None]] = {
        "xadd": lambda job: run_xadd(r, items, job),
        "library": lambda job: _library(r, items, job),
        "submit": lambda job: run_cli_in_process(url, native, job),
        "submit (process)": lambda job: run_cli_process(url, native, job),
        "xadd (OpenAI)": lambda job: run_xadd(r, oitems, job),
        "api": lambda job: run_api(Conductor(r), openai, job),
        "xadd (file)": lambda job: run_xadd_file(r, native, job),
        "xadd (OpenAI file)": lambda job: run_xadd_file(r, openai, job),
    }
    systems = SYSTEMS
    if old_tree is not None:
        runs[OLD] = lambda job: run_cli_process(url, native, job, old_tree)
        systems = (*SYSTEMS, OLD)
    rates: dict[str, list[float]] = {k: [] for k in systems}
    for rep in range(reps):
        order = list(systems[rep % len(systems):] + systems[:rep % len(systems)])
        for name in order:
            r.flushall()
            Conductor(r).ensure_model("bench")
            gc.collect()
            t0 = time.perf_counter()
            runs[name](f"job{rep}")
            wall = time.perf_counter() - t0
            rates[name].append(n / wall)
            log(f"  rep {rep} {name:17s} {n / wall:9.0f} items/s")
    return rates


def _library(r: redis.Redis, items: list[PreparedItem], job: str) -> None:
    rep = Conductor(r).submit(items, job)
    assert rep.accepted == len(items), rep


def ratios(rates: dict[str, list[float]], limit_of: dict[str, str] = LIMIT_OF) -> dict[str, float]:
    return {k: median([a / b for a, b in zip(rates[k], rates[lim], strict=True)]) for k, lim in limit_of.items()
            if k in rates}


def report(args: argparse.Namespace, mach: str, rates: dict[str, list[float]]) -> str:
    rat, frat = ratios(rates), ratios(rates, FILE_LIMIT_OF)
    rows = []
    for k in rates:
        lim = LIMIT_OF.get(k)
        ratio = f"**{rat[k]:.2f}x** of {lim} (goal {GOALS[k]:.1f}x: {'met' if rat[k] >= GOALS[k] else 'NOT met'})" \
            if lim else "the limit"
        like = f"{frat[k]:.2f}x of {FILE_LIMIT_OF[k]}" if k in frat else "-"
        rows.append((k, f"{median(rates[k]):,.0f}", ", ".join(f"{x:,.0f}" for x in rates[k]), ratio, like))
    return "\n".join([
        "## Intake speed: conductor submit, the Batch API's intake, the library, the plain-XADD limit (issue 25)",
        "",
        f"{now_utc()}, commit {git_rev()}, {mach}.",
        "",
        f"`{command_line()}`",
        "",
        f"{args.items:,} items (prompts of about 300 bytes, 20 shapes), {args.reps} repetitions, systems "
        "interleaved (order rotated); items/s = items / wall seconds; the ratio is paired per repetition, "
        "then the median.",
        "",
        table(("system", "items/s (median)", "per repetition", "ratio to its limit", "like for like: a plain "
               "producer reading the same file"), rows),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, help="lines per file (50,000; quick 2,000)")
    p.add_argument("--reps", type=int, help="repetitions (5; quick 1)")
    p.add_argument("--quick", action="store_true", help="small sizes; prints, writes nothing")
    p.add_argument("--no-write", action="store_true", help="do not rewrite bench/RESULTS.md")
    p.add_argument("--old-tree", type=Path, help="source tree of an earlier commit: its conductor submit too")
    args = p.parse_args(argv)
    args.items = args.items or (2000 if args.quick else 50_000)
    args.reps = args.reps or (1 if args.quick else 5)
    args.no_write = args.no_write or args.quick
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis() as srv:
        native, openai = write_files(Path(d), args.items)
        r = connect(srv.url)
        mach = machine(r)
        print(f"redis-server on port {srv.port}; {mach}", flush=True)
        rates = bench(srv.url, r, native, openai, args.reps, old_tree=args.old_tree)
        text = report(args, mach, rates)
    publish(text, "intake_speed", write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
