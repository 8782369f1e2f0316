"""``conductor``: submit, work, read results, watch and inspect, from the command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conductor.errors import BadInput, ConductorError, DuplicateId
from conductor.formats import PreparedItem, parse_line

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def _url(args: argparse.Namespace) -> str:
    return args.redis or os.environ.get("CONDUCTOR_REDIS_URL") or DEFAULT_URL


def _conductor(args: argparse.Namespace):  # noqa: ANN202
    from conductor.client import Conductor
    wait = args.wait_replicas if getattr(args, "wait_replicas", None) is not None else \
        int(os.environ.get("CONDUCTOR_WAIT_REPLICAS", "0") or 0)
    return Conductor.from_url(_url(args), wait_replicas=wait)


def _progress(done: int, total: int, enabled: bool) -> None:
    if not enabled or total <= 0:
        return
    width = 30
    filled = int(width * done / total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def read_items(path: str, *, skip_invalid: bool, rejects: str | None,
               lines: dict[str, int] | None = None) -> list[PreparedItem]:
    """Validate every line first: by default a file with a bad line submits nothing. ``lines``, when
    given, gets each item's line number by id."""
    items: list[PreparedItem] = []
    errors: list[tuple[int, bytes, BadInput]] = []
    seen: dict[str, tuple[int, str]] = {}  # id -> (first line, model): one id, one item of the job
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            try:
                it = parse_line(line, n)
                first, model = seen.setdefault(it.id, (n, it.model))
                if first != n:
                    across = f" (there for model {model}: an id names one item of a job, across its models)" \
                        if model != it.model else ""
                    raise BadInput("id", f"duplicate of line {first}{across}", n)
                items.append(it)
                if lines is not None:
                    lines[it.id] = n
            except BadInput as e:
                errors.append((n, line, e))
    if errors:
        if rejects:
            with open(rejects, "wb") as f:
                for n, line, e in errors:
                    f.write(json.dumps({"line": n, "field": e.field, "error": str(e),
                                        "raw": line.decode("utf-8", "replace")}).encode() + b"\n")
        for _, _, e in errors[:20]:
            print(f"error: {e}", file=sys.stderr)
        if len(errors) > 20:
            print(f"error: ... and {len(errors) - 20} more", file=sys.stderr)
        if not skip_invalid:
            raise ConductorError(f"{len(errors)} invalid line(s) in {path}; nothing submitted "
                                 "(--skip-invalid submits the valid ones)")
    return items


def default_job(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).stem)[:100] or "job"


def declare_file(c: Any, job: str, items: list[PreparedItem], lines: dict[str, int]) -> None:
    """Before the first item is sent: the ids checked against the job's other models, then the
    file's item count per model recorded (Conductor.declare), so that `conductor status` can tell
    a job that lost items (a failover, a submit that stopped halfway) from a finished one."""
    by_model: dict[str, list[PreparedItem]] = {}
    for it in items:
        by_model.setdefault(it.model, []).append(it)
    try:
        c.check_ids_across_models(job, by_model)
    except DuplicateId as e:  # the job has the id under another model (an earlier run)
        raise DuplicateId(e.item_id, e.detail, lines.get(e.item_id)) from None
    c.declare(job, {m: len(its) for m, its in by_model.items()})  # ids are distinct in a file (read_items)


def cmd_submit(args: argparse.Namespace) -> int:
    lines: dict[str, int] = {}
    items = read_items(args.file, skip_invalid=args.skip_invalid, rejects=args.rejects, lines=lines)
    c = _conductor(args)
    job = args.job or default_job(args.file)
    declare_file(c, job, items, lines)
    show = sys.stderr.isatty() and not args.quiet
    step = 20_000  # items per Conductor.submit: each call groups its items by shape (client.py)
    accepted = dupes = 0
    for start in range(0, len(items), step):
        try:
            rep = c.submit(items[start:start + step], job, seal=start + step >= len(items))
        except DuplicateId as e:  # the job has the id under another model (an earlier run)
            raise DuplicateId(e.item_id, e.detail, lines.get(e.item_id)) from None
        accepted += rep.accepted
        dupes += rep.duplicates
        _progress(min(start + step, len(items)), len(items), show)
    print(job)
    if not args.quiet:
        print(f"submitted {accepted} items ({dupes} already there) to job {job}", file=sys.stderr)
    return 0


def build_engine(args: argparse.Namespace):  # noqa: ANN202
    from workers.engines import make_engine
    kw: dict[str, Any] = {"model": args.model}
    if args.engine == "sim":
        kw.update(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                  max_input_len=args.max_input_len, time_scale=args.sim_time_scale)
    else:
        kw.update(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                  max_input_len=args.max_input_len, model_path=args.model_path)
    return make_engine(args.engine, **kw)


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.latch import AdmissionLatch, LatchConfigError
    from workers.worker import Worker, WorkerOptions
    try:
        AdmissionLatch(args.high_water, args.low_water)
    except LatchConfigError as e:
        raise ConductorError(str(e)) from None
    engine = build_engine(args)
    if args.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port)
    opts = WorkerOptions(name=args.name or "", high_water=args.high_water, low_water=args.low_water,
                         pending_ceiling=args.pending_ceiling, drain_s=args.drain_s,
                         heartbeat_ttl_s=args.heartbeat_ttl, idle_exit_s=args.idle_exit,
                         max_batches=args.max_batches)
    w = Worker(_conductor(args), engine, opts)
    w.install_signals()
    w.run()
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    c = _conductor(args)
    out = open(args.output, "wb") if args.output else sys.stdout.buffer
    try:
        for rec in c.results(args.job, follow=args.follow):
            out.write(rec + b"\n")
            if args.follow:
                out.flush()
    finally:
        if args.output:
            out.close()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    c = _conductor(args)
    while True:
        st = c.status(args.job)
        if not st["models"]:
            raise ConductorError(f"job {args.job!r} is unknown to this Redis")
        if args.json:
            print(json.dumps(st), flush=True)
        else:
            print(f"job {st['job']}: submitted {st['submitted']}, completed {st['completed']}, "
                  f"failed {st['failed']}, pending {st['pending']}"
                  + (f", lost {st['lost']}" if st["lost"] else ""), flush=True)
        if st["lost"] and (not args.watch or st["done"]):
            print(f"error: {st['lost']} item(s) the producer sent to job {args.job} are missing from this Redis "
                  f"(declared {st['declared']}, present {st['submitted']}): a failover to a replica that had not "
                  "received them, or a submit that stopped halfway. Submit the same file again with the same "
                  "--job: submission is idempotent, only the missing items are added.", file=sys.stderr)
            return 3
        if not args.watch or st["done"]:
            return 0
        time.sleep(args.interval)


def cmd_inspect(args: argparse.Namespace) -> int:
    from conductor.inspect import model_overview, render
    c = _conductor(args)
    models = [args.model] if args.model else c.models()
    if args.verify or args.repair:
        from conductor.verify import cli_verify
        return cli_verify(c.r, models, do_repair=args.repair, show_all=args.all, ledger=not args.no_ledger,
                          as_json=args.json)
    views = [model_overview(c, m, lanes=args.lanes) for m in models]
    if args.json:
        print(json.dumps(views, default=str))
    else:
        print("\n".join(render(v) for v in views) or "no models")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from conductor.client import connect
    from conductor.schema import current, migrate
    r = connect(_url(args))
    applied = migrate(r)
    print(f"schema {current(r)}" + (f" (applied {applied})" if applied else " (up to date)"))
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    c = _conductor(args)
    if args.resume:
        c.resume(args.model)
        print(f"{args.model}: resumed")
    else:
        c.pause(args.model)
        print(f"{args.model}: paused (every write refused until 'conductor resume {args.model}'; "
              "workers and producers wait)")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from conductor.config import parse_value
    c = _conductor(args)
    values = {}
    for kv in args.values:
        name, sep, raw = kv.partition("=")
        if not sep:
            raise ConductorError(f"config: expected name=value, got {kv!r}")
        try:
            values[name] = parse_value(name, raw)
        except ValueError as e:
            raise ConductorError(str(e)) from None
    c.set_config(args.model, values)
    for k, v in sorted(c.config(args.model).items()):
        print(f"{k} = {v}")
    return 0


def cmd_dead_letter(args: argparse.Namespace) -> int:
    from conductor.deadletter import DeadLetter
    dl = DeadLetter(_conductor(args))
    if args.action == "list":
        for d in dl.items(model=args.model, job=args.job):
            print(json.dumps(d.as_dict()))
    elif args.action == "retry":
        print(json.dumps(dl.retry(model=args.model, job=args.job)))
    else:
        print(json.dumps({"purged": dl.purge(model=args.model, job=args.job)}))
    return 0


def cmd_reclaim(args: argparse.Namespace) -> int:
    c = _conductor(args)
    print(json.dumps(c.reclaim_dead(args.model, min_idle_ms=args.min_idle_ms)))
    return 0


def cmd_trim_results(args: argparse.Namespace) -> int:
    """Retention: drop a finished job's results older than --older-than-s (readers had their time)."""
    from conductor.retention import trim_job_results
    c = _conductor(args)
    if not c.job_models(args.job):
        raise ConductorError(f"job {args.job!r} is unknown to this Redis")
    try:
        n = trim_job_results(c, args.job, int((time.time() - args.older_than_s) * 1000))
    except Exception as e:  # noqa: BLE001 - the script's refusal (work left) is one line for the operator
        raise ConductorError(f"trim-results: {e}") from None
    print(f"trimmed {n} result records of job {args.job}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """The main job in one command: submit, work with N workers per model, collect results."""
    from conductor.embedded import EmbeddedRedis
    items = read_items(args.file, skip_invalid=args.skip_invalid, rejects=args.rejects)
    server = None
    url = args.redis or os.environ.get("CONDUCTOR_REDIS_URL")
    if url:
        print(f"using Redis at {url}", file=sys.stderr)
    else:
        server = EmbeddedRedis().start()
        url = server.url
        print(f"using an embedded redis-server on {url} for this run (pass --redis URL to use yours)",
              file=sys.stderr)
    procs: list[subprocess.Popen] = []
    try:
        from conductor.client import Conductor
        c = Conductor.from_url(url)
        job = args.job or default_job(args.file)
        t0 = time.monotonic()
        models = sorted({it.model for it in items})
        for m in models:
            if args.quiet_ms is not None:
                c.set_config(m, {"quiet_ms": args.quiet_ms})
        for m in models:
            for i in range(args.workers):
                cmd = [sys.executable, "-m", "conductor", "--redis", url, "--log-level", "warning", "worker",
                       "--engine", args.engine, "--model", m, "--name", f"run-{m}-{i}",
                       "--max-batch-size", str(args.max_batch_size),
                       "--max-batch-tokens", str(args.max_batch_tokens),
                       "--max-input-len", str(args.max_input_len),
                       "--sim-time-scale", str(args.sim_time_scale)]
                if args.model_path:
                    cmd += ["--model-path", args.model_path]
                procs.append(subprocess.Popen(cmd))
        declare_file(c, job, items, {})
        rep = c.submit(items, job, seal=True)
        print(f"job {job}: {rep.accepted} items submitted ({rep.duplicates} already there), "
              f"{len(models)} model(s), {args.workers} worker(s) each", file=sys.stderr)
        n = 0
        with open(args.output, "wb") as out:
            for rec in c.results(job, follow=True, block_ms=200,
                                 should_stop=lambda: all(p.poll() is not None for p in procs)):
                out.write(rec + b"\n")
                n += 1
        st = c.status(job)
        dt = time.monotonic() - t0
        print(f"job {job}: {st['completed']} completed, {st['failed']} failed, {st['pending']} pending; "
              f"{n} results in {args.output}; {dt:.2f}s ({n / dt if dt else 0:.0f} results/s)", file=sys.stderr)
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


def _engine_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--engine", choices=["sim", "torch", "trtllm"], default="sim")
    if model_required:
        p.add_argument("--model", required=True, help="model name (the engine's identity)")
    p.add_argument("--model-path", help="torch/trtllm: local model folder (torch: 'tiny' for a random tiny Llama)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--max-input-len", type=int, default=4096)
    p.add_argument("--sim-time-scale", type=float, default=0.0, help="sim: multiply sleeps by F (0: no sleeping)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conductor", description=__doc__)
    p.add_argument("--redis", help=f"Redis URL (env CONDUCTOR_REDIS_URL; default {DEFAULT_URL}; rediss:// for TLS)")
    p.add_argument("--wait-replicas", type=int, default=None, metavar="N",
                   help="submit and complete wait until N replicas hold their writes (env CONDUCTOR_WAIT_REPLICAS; "
                        "default 0)")
    p.add_argument("--log-level", default="info")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("submit", help="validate and submit a JSONL file, print the job id, exit")
    s.add_argument("file")
    s.add_argument("--job")
    s.add_argument("--skip-invalid", action="store_true", help="submit the valid lines, reject the others")
    s.add_argument("--rejects", help="write rejected lines here (JSON lines with line, field, error)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_submit)

    w = sub.add_parser("worker", help="run one worker (one per GPU)")
    _engine_flags(w)
    w.add_argument("--name")
    w.add_argument("--high-water", type=int)
    w.add_argument("--low-water", type=int)
    w.add_argument("--pending-ceiling", type=int)
    w.add_argument("--drain-s", type=float, default=30.0)
    w.add_argument("--heartbeat-ttl", type=float, default=10.0)
    w.add_argument("--idle-exit", type=float, help="exit after this many seconds with nothing to do")
    w.add_argument("--max-batches", type=int)
    w.add_argument("--metrics-port", type=int)
    w.set_defaults(fn=cmd_worker)

    r = sub.add_parser("results", help="print a job's results as JSON lines")
    r.add_argument("job")
    r.add_argument("--follow", action="store_true", help="keep reading until every item has a result")
    r.add_argument("-o", "--output")
    r.set_defaults(fn=cmd_results)

    st = sub.add_parser("status", help="submitted, completed, failed, pending")
    st.add_argument("job")
    st.add_argument("--watch", action="store_true")
    st.add_argument("--json", action="store_true")
    st.add_argument("--interval", type=float, default=1.0)
    st.set_defaults(fn=cmd_status)

    i = sub.add_parser("inspect", help="shapes, lanes, waiting tokens, pending entries per consumer")
    i.add_argument("model", nargs="?")
    i.add_argument("--lanes", action="store_true")
    i.add_argument("--json", action="store_true")
    i.add_argument("--verify", action="store_true",
                   help="recompute every counter from the data it counts; exit 1 when any differs")
    i.add_argument("--repair", action="store_true", help="with --verify: rewrite differing counters from the truth")
    i.add_argument("--all", action="store_true", help="with --verify: list lane-level counters that agree too")
    i.add_argument("--no-ledger", action="store_true",
                   help="with --verify: skip the per-item ledger (lost/duplicated items; memory grows with items)")
    i.set_defaults(fn=cmd_inspect)

    m = sub.add_parser("migrate", help="bring the Redis key schema to this version (stop every worker and "
                       "submitter first: a migration rewrites the queues they work on)")
    m.set_defaults(fn=cmd_migrate)

    cf = sub.add_parser("config", help="show or set a model's thresholds: conductor config M name=value")
    cf.add_argument("model")
    cf.add_argument("values", nargs="*")
    cf.set_defaults(fn=cmd_config)

    for name, resume in (("pause", False), ("resume", True)):
        pa = sub.add_parser(name, help="refuse every write to a model's keys (to move its cluster slot or migrate "
                            "it without stopping processes)" if not resume else "undo conductor pause")
        pa.add_argument("model")
        pa.set_defaults(fn=cmd_pause, resume=resume)

    rc = sub.add_parser("reclaim", help="one reclaim sweep of a model's dead consumers")
    rc.add_argument("model")
    rc.add_argument("--min-idle-ms", type=int, default=0)
    rc.set_defaults(fn=cmd_reclaim)

    tr = sub.add_parser("trim-results", help="retention: drop a finished job's old result records")
    tr.add_argument("job")
    tr.add_argument("--older-than-s", type=float, default=86400.0)
    tr.set_defaults(fn=cmd_trim_results)

    dl = sub.add_parser("dead-letter", help="list, retry or purge dead-lettered items")
    dl.add_argument("action", choices=["list", "retry", "purge"])
    dl.add_argument("--job")
    dl.add_argument("--model")
    dl.set_defaults(fn=cmd_dead_letter)

    run = sub.add_parser("run", help="the main job: submit FILE, run N workers per model, write results")
    run.add_argument("file")
    _engine_flags(run, model_required=False)
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("-o", "--output", required=True)
    run.add_argument("--job")
    run.add_argument("--quiet-ms", type=int, help="intake silence before cleanup mode (model config)")
    run.add_argument("--skip-invalid", action="store_true")
    run.add_argument("--rejects")
    run.set_defaults(fn=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(message)s", stream=sys.stderr)
    try:
        return args.fn(args)
    except ConductorError as e:
        print(f"conductor: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"conductor: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
