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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conductor import keys as K
from conductor.cli_args import (
    LOG_LEVELS,
    DefaultsFormatter,
    Parser,
    log_level,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from conductor.errors import ConductorError

if TYPE_CHECKING:
    from conductor.client import Conductor

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def _url(args: argparse.Namespace) -> str:
    return args.redis or os.environ.get("CONDUCTOR_REDIS_URL") or DEFAULT_URL


def _conductor(args: argparse.Namespace) -> Conductor:
    from conductor.client import Conductor
    wait = args.wait_replicas if getattr(args, "wait_replicas", None) is not None else \
        int(os.environ.get("CONDUCTOR_WAIT_REPLICAS", "0") or 0)
    from conductor.store import store_from
    return Conductor.from_url(_url(args), wait_replicas=wait, store=store_from(getattr(args, "store", None)))


def default_job(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).stem)[:100] or "job"


def cmd_submit(args: argparse.Namespace) -> int:
    from conductor.config import ModelDefaults
    from conductor.progress import ProgressLine
    from conductor.submit_file import LARGE_SUBMIT, check_file, prepare_job, send_file
    conductors: list[Any] = []  # connected only when a line needs a model's default (or to submit)

    def redis_client() -> Any:
        if not conductors:
            conductors.append(_conductor(args))
        return conductors[0].r
    found = check_file(args.file, skip_invalid=args.skip_invalid, rejects=args.rejects,
                       default_max_tokens=ModelDefaults(redis_client).max_tokens)
    redis_client()
    c = conductors[0]
    job = args.job or default_job(args.file)
    prepare_job(c, found, job)  # nothing is written when any part of the file would be refused
    from conductor.cli_batch import start_job
    start_job(c, job, args)
    live = sys.stderr.isatty() and found.items >= LARGE_SUBMIT and not args.quiet
    with ProgressLine(f"submit {job}", found.items, sys.stderr, live=live) as line:
        sent = send_file(c, found, job, progress=None if args.quiet else line.update)
    print(job)
    if not args.quiet:
        print(f"submitted {sent.accepted} items ({sent.duplicates} already there) to job {job}", file=sys.stderr)
    return 0


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """make_engine's keyword arguments from the engine flags (plain data: the agent sends them on)."""
    kw: dict[str, Any] = {"model": args.model}
    if args.engine == "sim":
        kw.update(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                  max_input_len=args.max_input_len, time_scale=args.sim_time_scale)
    else:
        kw.update(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                  max_input_len=args.max_input_len, model_path=args.model_path)
    return kw


def build_engine(args: argparse.Namespace) -> Any:  # an engine (conductor.workers.engines.base.Engine)
    from conductor.workers.engines import make_engine
    return make_engine(args.engine, **engine_kwargs(args))


def cmd_worker(args: argparse.Namespace) -> int:
    from conductor.workers.latch import AdmissionLatch, LatchConfigError
    from conductor.workers.worker import Worker, WorkerOptions
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


def cmd_agent(args: argparse.Namespace) -> int:
    from conductor.workers.host_agent import HostAgent
    from conductor.workers.worker import WorkerOptions
    if args.engine != "sim" and not args.model_path:
        raise ConductorError(f"--model-path: required with --engine {args.engine}")
    c = _conductor(args)
    c.r.ping()  # an unreachable Redis is refused before GPU processes load their engines
    opts = WorkerOptions(name=args.name or "", drain_s=args.drain_s, heartbeat_ttl_s=args.heartbeat_ttl,
                         idle_exit_s=args.idle_exit, max_batches=args.max_batches)
    agent = HostAgent(c, {"kind": args.engine, **engine_kwargs(args)}, args.gpus, opts, depth=args.depth,
                      ring_bytes=args.ring_mb << 20)
    agent.install_signals()
    agent.run()
    return 0


def _known_job(c: Conductor, job: str) -> list[str]:
    """The job's models; an unknown job is an error (a typo would otherwise read nothing, or
    follow forever)."""
    models = c.job_models(job)
    if not models:
        raise ConductorError(f"job {job!r} is unknown to this Redis (conductor jobs lists the jobs)")
    return models


def cmd_results(args: argparse.Namespace) -> int:
    from conductor.fleet import NoWorkerHint
    from conductor.rewind import REWIND_WINDOW, Rewind
    c = _conductor(args)
    models = _known_job(c, args.job)
    hint = NoWorkerHint(c.r, models) if args.follow else None

    def waiting() -> bool:
        if hint is not None and not c.status(args.job)["done"]:
            hint.check(c.job_models(args.job))
        return False

    if args.follow:
        waiting()
    rewinds = []

    def rewound(rw: Rewind) -> None:
        rewinds.append(rw)
        lost = "" if rw.all_known else f" (more than the last {REWIND_WINDOW} it read: some may come twice)"
        print(f"conductor: results stream {rw.stream} was rewound from {rw.read_up_to} to {rw.now_at}: a failover "
              f"lost results Redis had acknowledged; {len(rw.ids)} results this reader printed past that point "
              f"will be produced again and are skipped{lost}", file=sys.stderr, flush=True)

    if args.errors and args.format != "openai":
        raise ConductorError("--errors goes with --format openai")
    out = open(args.output, "wb") if args.output else sys.stdout.buffer
    try:
        records = c.results(args.job, follow=args.follow, should_stop=waiting, on_rewind=rewound)
        if args.format == "openai":
            from conductor.openai_format import write_openai
            with open(args.errors, "wb") if args.errors else _no_file() as errors:
                write_openai(records, out, errors)
            return 1 if rewinds else 0
        for rec in records:
            out.write(rec + b"\n")
            if args.follow:
                out.flush()
    finally:
        if args.output:
            out.close()
    return 1 if rewinds else 0


def _no_file() -> Any:
    import contextlib
    return contextlib.nullcontext(None)


def _status_line(st: dict[str, Any]) -> str:
    return (f"job {st['job']}: submitted {st['submitted']}, completed {st['completed']}, "
            f"failed {st['failed']}, pending {st['pending']}" + (f", lost {st['lost']}" if st.get("lost") else ""))


def cmd_status(args: argparse.Namespace) -> int:
    from conductor.fleet import NoWorkerHint
    from conductor.progress import ProgressLine, Rate, fmt_eta
    c = _conductor(args)
    models = _known_job(c, args.job)
    st = c.status(args.job, models)
    if not args.watch and not args.json:
        from conductor.lifecycle import describe, render
        print(render(describe(c, args.job, advance=False)), flush=True)  # read only: a reader may not write
    if not args.watch or args.json:
        while True:
            print(json.dumps(st) if args.json else _status_line(st), flush=True)
            if st["lost"] and (not args.watch or st["done"]):
                return _lost(args.job, st)
            if not args.watch:
                return 0
            if st["done"]:
                return 1 if st["failed"] else 0
            time.sleep(args.interval)
            st = c.status(args.job, c.job_models(args.job))  # a later submit may have added a model
    hint = NoWorkerHint(c.r, models)
    if sys.stdout.isatty():
        with ProgressLine(f"job {args.job}", st["submitted"], sys.stdout, unit="answered") as line:
            while not st["done"]:
                hint.check(c.job_models(args.job))
                line.update(st["completed"] + st["failed"], st["submitted"], note=f"{st['failed']} failed")
                time.sleep(args.interval)
                st = c.status(args.job, c.job_models(args.job))
            line.update(st["completed"] + st["failed"], st["submitted"], note=f"{st['failed']} failed")
        print(_status_line(st), flush=True)
    else:
        rate = Rate()  # one plain line per interval, as before, with the rate and ETA added
        while True:
            answered = st["completed"] + st["failed"]
            rate.add(answered, time.monotonic())
            per_s = rate.per_s()
            extra = "" if st["done"] else (f", {per_s:,.1f}/s, {fmt_eta(rate.eta_s(answered, st['submitted']))}"
                                           if per_s is not None else "")
            print(_status_line(st) + extra, flush=True)
            if st["done"]:
                break
            hint.check(c.job_models(args.job))
            time.sleep(args.interval)
            st = c.status(args.job, c.job_models(args.job))
    if st["lost"]:
        return _lost(args.job, st)
    return 1 if st["failed"] else 0


def _lost(job: str, st: dict[str, Any]) -> int:
    print(f"error: {st['lost']} item(s) the producer sent to job {job} are missing from this Redis "
          f"(declared {st['declared']}, present {st['submitted']}): a failover to a replica that had not "
          "received them, or a submit that stopped halfway. Submit the same file again with the same "
          "--job: submission is idempotent, only the missing items are added.", file=sys.stderr)
    return 3


def cmd_jobs(args: argparse.Namespace) -> int:
    from conductor.jobs import list_jobs, render
    rows = list_jobs(_conductor(args), limit=args.limit or None)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows]))
    else:
        print(render(rows))
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    from conductor.exporter import serve
    return serve(_url(args), args.port, args.host, starving_s=args.starving_s, top_shapes=args.top_shapes,
                 jobs=args.jobs)


def cmd_inspect(args: argparse.Namespace) -> int:
    from conductor.inspect import model_overview, render
    c = _conductor(args)
    models = [args.model] if args.model else c.models()
    if args.verify or args.repair:
        from conductor.verify import cli_verify
        return cli_verify(c.r, models, do_repair=args.repair, show_all=args.all, ledger=not args.no_ledger,
                          as_json=args.json, store=c.tier.store if c.tier else None)
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


def _known_model(c: Conductor, model: str, create: bool = False) -> None:
    """A typo would otherwise register a model for good (cdr:models, its config and group)."""
    if create or c.r.sismember(K.MODELS_KEY, model):
        return
    known = c.models()
    shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
    raise ConductorError(f"model {model!r} is unknown to this Redis (known: {shown or 'none'}); "
                         "--create makes it")


def cmd_pause(args: argparse.Namespace) -> int:
    c = _conductor(args)
    _known_model(c, args.model, getattr(args, "create", False))
    if args.resume:
        c.resume(args.model)
        print(f"{args.model}: resumed")
    else:
        c.pause(args.model)
        print(f"{args.model}: paused until 'conductor resume {args.model}': every write is refused; workers "
              "wait, producers are refused (submit exits 2, nothing written; submit again after resume)")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from conductor.config import parse_value
    c = _conductor(args)
    _known_model(c, args.model, args.create)
    values = {}
    for kv in args.values:
        name, sep, raw = kv.partition("=")
        if not sep:
            raise ConductorError(f"config: expected name=value, got {kv!r}")
        try:
            values[name] = parse_value(name, raw)
        except ValueError as e:
            raise ConductorError(str(e)) from None
    if values:
        c.set_config(args.model, values)
    # Showing writes nothing (a reader or producer may look): an unset threshold shows its default.
    from conductor.config import DEFAULTS
    shown = {k: str(v) for k, v in DEFAULTS.items()} | c.config(args.model)
    for k, v in sorted(shown.items()):
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
        n = sum(1 for _ in dl.items(model=args.model, job=args.job))
        if n and not args.yes and not _confirmed(f"purge {n} dead-lettered items for good (their failed results "
                                                 "stay)?"):
            raise ConductorError(f"dead-letter purge deletes {n} items for good: nothing purged (pass --yes; "
                                 "conductor dead-letter list shows them)")
        print(json.dumps({"purged": dl.purge(model=args.model, job=args.job) if n else 0}))
    return 0


def _confirmed(question: str) -> bool:
    """A yes from a person at a terminal; never from a pipe or a script (they pass --yes)."""
    if not sys.stdin.isatty():
        return False
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


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


def cmd_run(args: argparse.Namespace) -> int:  # noqa: C901 - the whole `conductor run` lifecycle: start, submit, watch, stop, in order
    """The main job in one command: submit, work with N workers per model, collect results."""
    from conductor.embedded import EmbeddedRedis, free_port
    from conductor.progress import ProgressLine
    from conductor.run_summary import RunSummary
    from conductor.submit_file import check_file, prepare_job, send_file
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
        from conductor.store import store_from
        c = Conductor.from_url(url, store=store_from(args.store))
        job = args.job or default_job(args.file)
        prepare_job(c, found, job)
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
        summary.scrape_prefix_hits(ports)
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


def _engine_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--engine", choices=["sim", "torch", "trtllm"], default="sim",
                   help="sim: a cost model, no GPU; torch: transformers; trtllm: TensorRT-LLM")
    if model_required:
        p.add_argument("--model", required=True, help="model name (the engine's identity in the conductor)")
    p.add_argument("--model-path", help="torch/trtllm: local model folder (torch: 'tiny' for a random tiny Llama)")
    p.add_argument("--max-batch-size", type=positive_int, default=64, help="items per batch (the contract)")
    p.add_argument("--max-batch-tokens", type=positive_int, default=8192,
                   help="input tokens per batch, padded in memory mode (the contract)")
    p.add_argument("--max-input-len", type=positive_int, default=4096,
                   help="longest input the engine takes; longer items get an error result")
    p.add_argument("--sim-time-scale", type=non_negative_float, default=0.0,
                   help="sim: multiply the cost model's sleeps by this (0: no sleeping)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("conductor")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="conductor", description=__doc__, formatter_class=DefaultsFormatter,
               epilog="Exit status: 0 done; 1 finished but not clean (items failed or pending, counter drift); "
                      "2 refused (bad arguments or input, unknown job or model, Redis unreachable); "
                      "130 interrupted; 141 the reader of the output went away.")
    p.add_argument("--version", action="version", version=f"conductor {_version()}")
    p.add_argument("--redis", metavar="URL",
                   help=f"Redis URL; rediss:// for TLS, ?cluster=1 for Redis Cluster "
                        f"(default: env CONDUCTOR_REDIS_URL, else {DEFAULT_URL})")
    p.add_argument("--store", metavar="URL",
                   help="disk tier: a directory or fsspec URL (s3://bucket/prefix with s3fs) for store segments; "
                        "used for models with a resident_tokens ceiling (env CONDUCTOR_STORE; README: Disk tier)")
    p.add_argument("--wait-replicas", type=non_negative_int, default=None, metavar="N",
                   help="submit and complete wait until N replicas hold their writes "
                        "(default: env CONDUCTOR_WAIT_REPLICAS, else 0)")
    p.add_argument("--log-level", type=log_level, default="info", metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str, fn: Callable[[argparse.Namespace], int], **kw: Any) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help, formatter_class=DefaultsFormatter, **kw)
        c.set_defaults(fn=fn)
        return c

    s = command("submit", "validate and submit a JSONL or Parquet file, print the job id, exit", cmd_submit)
    s.add_argument("file", help="JSON lines or Parquet: native or OpenAI batch format (README: Input lines)")
    s.add_argument("--job", help="job id (default: the file's name without its extension)")
    s.add_argument("--skip-invalid", action="store_true", help="submit the valid lines, reject the others")
    s.add_argument("--rejects", metavar="FILE", help="write rejected lines here (JSON lines with line, field, error)")
    s.add_argument("--quiet", action="store_true", help="print only the job id")
    from conductor.cli_batch import add_commands, add_submit_flags
    add_submit_flags(s)

    w = command("worker", "run one worker (one per GPU)", cmd_worker)
    _engine_flags(w)
    w.add_argument("--name", help="consumer name, unique among live workers of the model (default: the host "
                                  "name, plus the systemd instance when run from a template unit)")
    w.add_argument("--high-water", type=positive_int, help="admission latch: stop new prefills at this many "
                                                          "active sequences (with --low-water)")
    w.add_argument("--low-water", type=non_negative_int, help="admission latch: admit again at this many")
    w.add_argument("--pending-ceiling", type=positive_int,
                   help="items pulled and not yet written back, at most (default: no ceiling)")
    w.add_argument("--drain-s", type=non_negative_float, default=30.0,
                   help="on SIGTERM: seconds to finish in-flight work before handing it back")
    w.add_argument("--heartbeat-ttl", type=positive_float, default=10.0,
                   help="seconds without a heartbeat before other workers reclaim this one's batches")
    w.add_argument("--idle-exit", type=non_negative_float, help="exit after this many seconds with nothing to do "
                                                               "(default: never)")
    w.add_argument("--max-batches", type=positive_int, help="exit after claiming this many batches (default: no "
                                                           "limit)")
    w.add_argument("--metrics-port", type=port, help="serve Prometheus metrics on this port (default: none)")

    ag = command("agent", "run a host agent: claim for N GPU processes of this host, hand batches over shared "
                          "memory (README: Same-host handoff)", cmd_agent)
    _engine_flags(ag)
    ag.add_argument("--gpus", type=positive_int, default=1, help="GPU processes to start (one engine each)")
    ag.add_argument("--depth", type=positive_int, default=2,
                    help="batches handed to one GPU process at most (running plus waiting in its ring)")
    ag.add_argument("--ring-mb", type=positive_int, default=8,
                    help="shared-memory ring per GPU process, MiB; a batch record may take a quarter of it")
    ag.add_argument("--name", help="consumer name, unique among live workers of the model (default: the host name)")
    ag.add_argument("--drain-s", type=non_negative_float, default=30.0,
                    help="on SIGTERM: seconds for the GPU processes to finish before their batches are handed back")
    ag.add_argument("--heartbeat-ttl", type=positive_float, default=10.0,
                    help="seconds without a heartbeat before other workers reclaim this agent's batches")
    ag.add_argument("--idle-exit", type=non_negative_float, help="exit after this many seconds with nothing to "
                                                                "do (default: never)")
    ag.add_argument("--max-batches", type=positive_int, help="exit after claiming this many batches (default: no "
                                                            "limit)")

    add_commands(command)

    jb = command("jobs", "list jobs: created, models, submitted, completed, failed, pending, state", cmd_jobs)
    jb.add_argument("--json", action="store_true", help="one JSON list of job objects")
    jb.add_argument("--limit", type=non_negative_int, default=100, help="the newest this many jobs (0: all)")

    r = command("results", "print a job's results as JSON lines", cmd_results)
    r.add_argument("job", help="job id (conductor jobs lists them)")
    r.add_argument("--follow", action="store_true", help="keep reading until every item has a result")
    r.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    r.add_argument("--format", choices=("native", "openai"), default="native",
                   help="native result lines (README: Result lines) or OpenAI batch output lines")
    r.add_argument("--errors", metavar="FILE", help="with --format openai: failed lines go to FILE (OpenAI's "
                                                    "error file) instead of the output")

    st = command("status", "a job's submitted, completed, failed and pending items", cmd_status)
    st.add_argument("job", help="job id (conductor jobs lists them)")
    st.add_argument("--watch", action="store_true",
                    help="repeat until every item has a result; exit 1 if any failed")
    st.add_argument("--json", action="store_true", help="one JSON object per report")
    st.add_argument("--interval", type=positive_float, default=1.0, help="seconds between reports with --watch")

    i = command("inspect", "shapes, lanes, waiting tokens, pending entries per consumer", cmd_inspect)
    i.add_argument("model", nargs="?", help="one model (default: every model)")
    i.add_argument("--lanes", action="store_true", help="list every lane of every shape")
    i.add_argument("--json", action="store_true", help="one JSON list of model views")
    i.add_argument("--verify", action="store_true",
                   help="recompute every counter from the data it counts; exit 1 when any differs")
    i.add_argument("--repair", action="store_true", help="with --verify: rewrite differing counters from the truth")
    i.add_argument("--all", action="store_true", help="with --verify: list lane-level counters that agree too")
    i.add_argument("--no-ledger", action="store_true",
                   help="with --verify: skip the per-item ledger (lost/duplicated items; memory grows with items)")

    ex = command("exporter", "serve the broker's figures for Prometheus (stateless: read from Redis on every "
                 "scrape; run any number, or none)", cmd_exporter)
    ex.add_argument("--port", type=port, default=9400, help="HTTP port of /metrics")
    ex.add_argument("--host", default="0.0.0.0", help="address to listen on")
    ex.add_argument("--starving-s", type=positive_float, default=30.0,
                    help="a lane whose head item waited longer counts as starving")
    ex.add_argument("--top-shapes", type=non_negative_int, default=10,
                    help="per model, the largest shape instances that get series of their own")
    ex.add_argument("--jobs", type=non_negative_int, default=500,
                    help="the newest jobs looked at for per-job series (only running ones get them)")

    command("migrate", "bring the Redis key schema to this version (stop every worker and submitter first: a "
            "migration rewrites the queues they work on)", cmd_migrate)

    from conductor.config import help_table
    cf = command("config", "show or set a model's thresholds: conductor config M name=value ...", cmd_config,
                 epilog=help_table())
    cf.formatter_class = _RawEpilogFormatter
    cf.add_argument("model", help="model name (conductor inspect lists them)")
    cf.add_argument("values", nargs="*", metavar="name=value", help="thresholds to set (listed below); none: show")
    cf.add_argument("--create", action="store_true", help="make the model if Redis does not know it yet")

    for name, resume in (("pause", False), ("resume", True)):
        pa = command(name, "refuse every write to a model's keys (to move its cluster slot or migrate it without "
                     "stopping processes)" if not resume else "undo conductor pause", cmd_pause)
        pa.add_argument("model", help="model name (conductor inspect lists them)")
        if not resume:
            pa.add_argument("--create", action="store_true", help="make the model if Redis does not know it yet "
                                                                  "(to pause it before its first item)")
        pa.set_defaults(resume=resume)

    rc = command("reclaim", "one reclaim sweep of a model's dead consumers", cmd_reclaim)
    rc.add_argument("model", help="model name (conductor inspect lists them)")
    rc.add_argument("--min-idle-ms", type=non_negative_int, default=0,
                    help="also take batches idle this long from live consumers (0: only dead consumers)")

    tr = command("trim-results", "retention: drop a finished job's old result records", cmd_trim_results)
    tr.add_argument("job", help="job id (conductor jobs lists them)")
    tr.add_argument("--older-than-s", type=non_negative_float, default=86400.0,
                    help="drop result records written more than this many seconds ago")

    dl = command("dead-letter", "list, retry or purge dead-lettered items", cmd_dead_letter)
    dl.add_argument("action", choices=["list", "retry", "purge"],
                    help="list the items, retry them (back to the queue) or purge them (gone for good)")
    dl.add_argument("--job", help="only this job's items (default: every job)")
    dl.add_argument("--model", help="only this model's items (default: every model)")
    dl.add_argument("--yes", action="store_true", help="purge without asking (a purge off a terminal needs it)")

    run = command("run", "the main job: submit FILE, run N workers per model, write results", cmd_run)
    run.add_argument("file", help="JSON lines or Parquet: native or OpenAI batch format (README: Input lines)")
    _engine_flags(run, model_required=False)
    run.add_argument("--workers", type=positive_int, default=2, help="worker processes per model")
    run.add_argument("-o", "--output", required=True, metavar="FILE", help="where the results go (JSON lines)")
    run.add_argument("--job", help="job id (default: the file's name without its extension)")
    run.add_argument("--quiet-ms", type=non_negative_int,
                     help="intake silence before cleanup mode (model config quiet_ms; default: the model's)")
    run.add_argument("--skip-invalid", action="store_true", help="submit the valid lines, reject the others")
    run.add_argument("--rejects", metavar="FILE", help="write rejected lines here (JSON lines with line, field, "
                                                       "error)")
    return p


class _RawEpilogFormatter(DefaultsFormatter):
    """Keeps the epilog's table rows on lines of their own."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.cmd == "config" and all("=" in e and not e.startswith("-") for e in extra):
        # argparse ends a '*' positional at the first option: `config M --create a=1` leaves a=1 over
        args.values += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level if isinstance(args.log_level, int) else logging.INFO,
                        format="%(message)s", stream=sys.stderr)
    try:
        status: int = args.fn(args)
        return status
    except BrokenPipeError:
        return _reader_went_away()
    except ConductorError as e:
        return _fail(str(e))
    except IsADirectoryError as e:
        return _fail(f"{e.filename} is a directory, not a file")
    except OSError as e:
        if e.filename is None:
            raise
        return _fail(f"{e.strerror}: {e.filename}")
    except KeyboardInterrupt:
        return 130
    except _redis_error() as e:
        return _fail(f"Redis refused or failed: {e}")


def _redis_error() -> type[Exception]:
    import redis  # not at the top: most commands fail or finish before they need it
    return redis.RedisError


def _fail(message: str) -> int:
    print(f"conductor: {message.splitlines()[0] if message else 'error'}", file=sys.stderr)
    return 2


def _reader_went_away() -> int:
    """``conductor results J | head``: the reader closed the pipe. Python would print a traceback
    when it flushes stdout at exit; point stdout at /dev/null so the exit is quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


if __name__ == "__main__":
    sys.exit(main())
