"""``conductor submit`` and ``conductor run``: a JSONL or Parquet file of items into a job
(conductor/intake/file_intake.py reads it in passes); ``run`` also starts the workers and collects the
results."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conductor.cli.connect import conductor_from
from conductor.errors import ConductorError
from conductor.redis_contract.records import JobClass


def default_job(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).stem)[:100] or "job"


def add_class_flags(p: argparse.ArgumentParser) -> None:
    """The job's class (conductor/jobs/job_class.py): whose work it is and how urgent."""
    p.add_argument("--tenant", default="", help="who the job's work is for: tenants share the fleet by weight "
                                                "(conductor tenant T --weight W); default: the job is its own")
    p.add_argument("--priority", default="batch", choices=("interactive", "batch", "background"),
                   help="interactive: claimed before any other work; background: only what nothing else wants")
    p.add_argument("--deadline", metavar="WHEN", help="when the job is due (1h, 90m, 2d from now, or an ISO 8601 "
                                                      "time): within a tenant the job due first goes first, and "
                                                      "conductor jobs reports one past it")


def job_class(args: argparse.Namespace) -> JobClass:
    from conductor.errors import BadInput
    from conductor.jobs.job_class import parse_deadline
    try:
        return JobClass(args.tenant, args.priority, parse_deadline(args.deadline, "--deadline"))
    except BadInput as e:
        raise ConductorError(str(e)) from None


def cmd_submit(args: argparse.Namespace) -> int:
    from conductor.cli.progress import ProgressLine
    from conductor.intake.file_intake import LARGE_SUBMIT, check_file, prepare_job, send_file
    from conductor.redis_contract.config import ModelDefaults
    conductors: list[Any] = []  # connected only when a line needs a model's default (or to submit)

    def redis_client() -> Any:
        if not conductors:
            conductors.append(conductor_from(args))
        return conductors[0].r
    found = check_file(args.file, skip_invalid=args.skip_invalid, rejects=args.rejects,
                       default_max_tokens=ModelDefaults(redis_client).max_tokens)
    redis_client()
    c = conductors[0]
    job = args.job or default_job(args.file)
    prepare_job(c, found, job, job_class(args))  # nothing is written when any part of the file would be refused
    from conductor.cli.batch_api import start_job
    start_job(c, job, args)
    live = sys.stderr.isatty() and found.items >= LARGE_SUBMIT and not args.quiet
    with ProgressLine(f"submit {job}", found.items, sys.stderr, live=live) as line:
        sent = send_file(c, found, job, progress=None if args.quiet else line.update)
    print(job)
    if not args.quiet:
        print(f"submitted {sent.accepted} items ({sent.duplicates} already there) to job {job}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:  # noqa: C901 - the whole `conductor run` lifecycle: start, submit, watch, stop, in order
    """The main job in one command: submit, work with N workers per model, collect results."""
    from conductor.cli.progress import ProgressLine
    from conductor.cli.run_summary import RunSummary
    from conductor.embedded import EmbeddedRedis, free_port
    from conductor.intake.file_intake import check_file, prepare_job, send_file
    found = check_file(args.file, skip_invalid=args.skip_invalid, rejects=args.rejects)
    server = None
    url = args.redis or os.environ.get("CONDUCTOR_REDIS_URL")
    if url:
        print(f"using Redis at {url}", file=sys.stderr)
    else:
        server = EmbeddedRedis().start()
        url = server.url
        print(f"using an embedded redis-server on {url} for this run (pass --redis URL to use yours)",
              file=sys.stderr)
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []  # each worker's metrics endpoint: the engines' prefix-cache hits are read there
    try:
        from conductor.client import Conductor
        from conductor.tier.object_store import store_from
        c = Conductor.from_url(url, store=store_from(args.store))
        job = args.job or default_job(args.file)
        prepare_job(c, found, job, job_class(args))
        t0 = time.monotonic()
        models = sorted(found.counts)
        for m in models:
            if args.quiet_ms is not None:
                c.set_config(m, {"quiet_ms": args.quiet_ms})
        for m in models:
            for i in range(args.workers):
                ports.append(free_port())
                store = ["--store", args.store] if args.store else []  # else CONDUCTOR_STORE, inherited
                cmd = [sys.executable, "-m", "conductor", "--redis", url, *store, "--log-level", "warning", "worker",
                       "--engine", args.engine, "--model", m, "--name", f"run-{m}-{i}",
                       "--max-batch-size", str(args.max_batch_size),
                       "--max-batch-tokens", str(args.max_batch_tokens),
                       "--max-input-len", str(args.max_input_len),
                       "--sim-time-scale", str(args.sim_time_scale), "--metrics-port", str(ports[-1])]
                if args.model_path:
                    cmd += ["--model-path", args.model_path]
                procs.append(subprocess.Popen(cmd))
        rep = send_file(c, found, job)
        print(f"job {job}: {rep.accepted} items submitted ({rep.duplicates} already there), "
              f"{len(models)} model(s), {args.workers} worker(s) each", file=sys.stderr)
        summary = RunSummary()
        shown = 0.0
        with open(args.output, "wb") as out, ProgressLine(f"job {job}", found.items, sys.stderr,
                                                          unit="results") as line:
            for rec in c.results(job, follow=True, block_ms=200,
                                 should_stop=lambda: all(p.poll() is not None for p in procs)):
                out.write(rec + b"\n")
                summary.add(rec)
                now = time.monotonic()
                if now - shown >= 0.1:  # the line redraws a few times a second; per result is waste
                    shown = now
                    line.update(summary.results)
            line.update(summary.results)
        summary.scrape_workers(ports)
        st = c.status(job)
        dt = time.monotonic() - t0
        n = summary.results
        print(f"job {job}: {st['completed']} completed, {st['failed']} failed, {st['pending']} pending; "
              f"{n} results in {args.output}; {dt:.2f}s ({n / dt if dt else 0:.0f} results/s)", file=sys.stderr)
        print(f"job {job}: {summary.text()}", file=sys.stderr)
        return 0 if st["pending"] == 0 else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if server:
            server.close()
