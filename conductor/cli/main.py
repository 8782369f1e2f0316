"""``conductor``: submit, work, read results, watch and inspect, from the command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from conductor.cli.admin import (
    cmd_config,
    cmd_dead_letter,
    cmd_migrate,
    cmd_pause,
    cmd_reclaim,
    cmd_tenant,
    cmd_tenants,
    cmd_trim_results,
)
from conductor.cli.args import (
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
from conductor.cli.cancel import add_commands as add_cancel_commands
from conductor.cli.connect import DEFAULT_URL
from conductor.cli.keys import add_commands as add_key_commands
from conductor.cli.read import cmd_exporter, cmd_inspect, cmd_jobs, cmd_results, cmd_status
from conductor.cli.run import Interrupted, cmd_run
from conductor.cli.serve import add_commands as add_serve_commands
from conductor.cli.submit import add_class_flags, add_submit_flags, cmd_submit
from conductor.cli.workers import cmd_agent, cmd_worker, consumer_flags, engine_flags
from conductor.errors import ConductorError


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("conductor")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    # the help's first line, plain text (the module's docstring is reST: its ``quotes`` showed in --help)
    p = Parser(prog="conductor", description="conductor: submit, work, read results, watch and inspect, from the "
                                             "command line. 'conductor COMMAND --help' shows a command's options.",
               formatter_class=DefaultsFormatter,
               epilog="Exit status: 0 done; 1 finished but not clean (items failed or pending, counter drift); "
                      "2 refused (bad arguments or input, unknown job or model, Redis unreachable) or a write "
                      "failed; 130 interrupted (run: SIGTERM=143, SIGHUP=129); 141 the reader of the output went away.")
    p.add_argument("--version", action="version", version=f"conductor {_version()}")
    p.add_argument("--redis", metavar="URL",
                   help=f"Redis URL; rediss:// for TLS, ?cluster=1 for Redis Cluster "
                        f"(default: env CONDUCTOR_REDIS_URL, else {DEFAULT_URL})")
    p.add_argument("--store", metavar="URL",
                   help="disk tier: a directory or fsspec URL (s3://bucket/prefix with s3fs) for store segments; "
                        "used for models with a resident_tokens ceiling (env CONDUCTOR_STORE; docs/configuration.md)")
    p.add_argument("--wait-replicas", type=non_negative_int, default=None, metavar="N",
                   help="submit and complete wait until N replicas hold their writes "
                        "(default: env CONDUCTOR_WAIT_REPLICAS, else 0)")
    p.add_argument("--log-level", type=log_level, default="info", metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, help: str, fn: Callable[[argparse.Namespace], int], **kw: Any) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help, formatter_class=DefaultsFormatter, **kw)
        c.set_defaults(fn=fn)
        global_flags_after(c)
        return c

    s = command("submit", "validate and submit a JSONL or Parquet file, print the job id, exit", cmd_submit)
    s.add_argument("file", help="JSON lines or Parquet: native or OpenAI batch format (docs/formats.md)")
    s.add_argument("--job", help="job id (default: the file's name without its extension); a job that exists is "
                                 "refused unless --resume, as run refuses it")
    s.add_argument("--resume", action="store_true",
                   help="add to the job when it exists (an interrupted submit, a file in parts): ids it has are "
                        "skipped, so a submit run again neither loses nor duplicates")
    s.add_argument("--skip-invalid", action="store_true", help="submit the valid lines, reject the others")
    s.add_argument("--rejects", metavar="FILE", help="write rejected lines here (JSON lines with line, field, error)")
    s.add_argument("--quiet", action="store_true", help="print only the job id")
    s.add_argument("--create", action="store_true",
                   help="submit to models Redis does not know yet (workers not started yet); without it a line "
                        "naming an unknown model (a typo) is refused, with a did-you-mean")
    add_submit_flags(s)
    add_class_flags(s)

    w = command("worker", "run one worker (one per GPU)", cmd_worker)
    engine_flags(w)
    w.add_argument("--name", help="consumer name, unique among live workers of the model (default: the host "
                                  "name plus the systemd instance when run from a template unit, else the "
                                  "first free one of host, host-2, host-3, ...)")
    w.add_argument("--high-water", type=positive_int, help="admission latch: stop new prefills at this many "
                                                          "active sequences (with --low-water)")
    w.add_argument("--low-water", type=non_negative_int, help="admission latch: admit again at this many")
    w.add_argument("--pending-ceiling", type=positive_int,
                   help="items pulled and not yet written back, at most (default: no ceiling)")
    w.add_argument("--drain-s", type=non_negative_float, default=30.0,
                   help="on SIGTERM: seconds to finish in-flight work before handing it back")
    consumer_flags(w, "this one's")
    w.add_argument("--metrics-port", type=port, help="serve Prometheus metrics on this port (default: none)")

    ag = command("agent", "run a host agent: claim for N GPU processes of this host, hand batches over shared "
                          "memory (docs/operations.md)", cmd_agent)
    engine_flags(ag)
    ag.add_argument("--gpus", type=positive_int, default=1, help="GPU processes to start (one engine each)")
    ag.add_argument("--depth", type=positive_int, default=2,
                    help="batches handed to one GPU process at most (running plus waiting in its ring)")
    ag.add_argument("--ring-mb", type=positive_int, default=8,
                    help="shared-memory ring per GPU process, MiB; a batch record may take a quarter of it")
    ag.add_argument("--name", help="consumer name, unique among live workers of the model (default: the host name)")
    ag.add_argument("--drain-s", type=non_negative_float, default=30.0,
                    help="on SIGTERM: seconds for the GPU processes to finish before their batches are handed back")
    consumer_flags(ag, "this agent's")

    add_cancel_commands(command)
    add_serve_commands(command)
    add_key_commands(command)
    from conductor.cli.retry import add_commands as add_ledger_commands
    add_ledger_commands(command)

    jb = command("jobs", "list jobs, oldest first, one row each: when created, its models, its input lines and how "
                 "each was answered (completed; failed: an error of the engine; cancelled; expired; refused at "
                 "validation; pending), its items in Redis, tenant ('-': its own), priority, deadline and state "
                 "(OpenAI's status names; 'past its deadline' when late)", cmd_jobs)
    jb.add_argument("--json", action="store_true", help="one JSON list of job objects")
    jb.add_argument("--limit", type=non_negative_int, default=100, help="the newest this many jobs (0: all)")

    r = command("results", "print a job's results as JSON lines", cmd_results)
    r.add_argument("job", help="job id (conductor jobs lists them)")
    r.add_argument("--follow", action="store_true", help="keep reading until every item has a result")
    r.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    r.add_argument("--format", choices=("native", "openai"), default="native",
                   help="native result lines (docs/formats.md) or OpenAI batch output lines")
    r.add_argument("--errors", metavar="FILE", help="with --format openai: failed lines go to FILE (OpenAI's "
                                                    "error file) instead of the output")

    st = command("status", "a job's state, its input lines and items by how each was answered (completed; failed: an "
                 "error of the engine; cancelled; expired; refused at validation; pending), its tenant, priority "
                 "and deadline, and its lifecycle times; then one line of its items", cmd_status)
    st.add_argument("job", help="job id (conductor jobs lists them)")
    st.add_argument("--watch", action="store_true",
                    help="repeat until every item has a result; exit 1 if any failed or expired (a cancel is not "
                         "a failure: 0)")
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
                   help="with --verify: skip the per-item ledger (lost/duplicated items; memory grows with items) "
                        "and the job ledgers of the jobs in flight (conductor verify-job)")

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

    from conductor.redis_contract.config import help_table
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

    tn = command("tenant", "show a tenant, or set its weight (its share of the fleet among tenants with work "
                           "waiting) and its Batch API limits", cmd_tenant)
    tn.add_argument("tenant", help="tenant name (conductor submit --tenant T; conductor keys create --tenant T)")
    tn.add_argument("--weight", type=float, help="its weight (default 1): weight 3 gets three times the share of 1")
    tn.add_argument("--max-enqueued-tokens", type=non_negative_int, metavar="N",
                    help="Batch API: input tokens of its batches not yet ended, at most (a batch past it: 429 "
                         "token_limit_exceeded, nothing written; 0: no limit)")
    tn.add_argument("--max-file-bytes", type=non_negative_int, metavar="N",
                    help="Batch API: bytes of one uploaded file, at most (0: the API's 200 MB)")
    tn.add_argument("--requests-per-minute", type=non_negative_int, metavar="N",
                    help="Batch API: requests of its keys per minute (past it: 429 with Retry-After; 0: no limit)")
    ts = command("tenants", "every tenant: weight, service, share of the last minute, waiting work; the jobs "
                            "without a tenant (each its own) as one row, '- (no tenant)'; then, when any tenant has "
                            "API keys or limits, the Batch API's use against each tenant's limits", cmd_tenants)
    ts.add_argument("model", nargs="?", help="one model (default: all)")
    ts.add_argument("--json", action="store_true", help="one JSON list of tenant objects")
    ts.add_argument("--limits", action="store_true",
                    help="only the Batch API's use against each tenant's limits (with --json: one JSON list)")

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
    run.add_argument("file", help="JSON lines or Parquet: native or OpenAI batch format (docs/formats.md)")
    engine_flags(run, model_required=False)
    run.add_argument("--workers", type=positive_int, default=2, help="worker processes per model")
    run.add_argument("-o", "--output", required=True, metavar="FILE", help="where the results go (JSON lines)")
    run.add_argument("--job", help="job id (default: the file's name without its extension; when this Redis has "
                                   "that job, the first free NAME-2, NAME-3, ...)")
    run.add_argument("--resume", action="store_true",
                     help="continue the job (--job, or the file's name) where it stopped; refused when the job ran "
                          "with other engine or contract options")
    run.add_argument("--quiet-ms", type=non_negative_int,
                     help="intake silence before cleanup mode (model config quiet_ms; default: the model's)")
    run.add_argument("--skip-invalid", action="store_true", help="submit the valid lines, reject the others")
    run.add_argument("--rejects", metavar="FILE", help="write rejected lines here (JSON lines with line, field, "
                                                       "error)")
    add_class_flags(run)
    return p


def global_flags_after(c: argparse.ArgumentParser) -> None:
    """The global options are taken after the command too (``conductor run F --redis URL``, as
    the commands' own messages suggest): SUPPRESS leaves the value given before the command, or
    the global default, in place unless the option is given here."""
    g = c.add_argument_group("global options (also before the command)")
    g.add_argument("--redis", metavar="URL", default=argparse.SUPPRESS, help="Redis URL (as before the command)")
    g.add_argument("--store", metavar="URL", default=argparse.SUPPRESS, help="disk tier store (as before the command)")
    g.add_argument("--wait-replicas", type=non_negative_int, metavar="N", default=argparse.SUPPRESS,
                   help="replicas to wait for (as before the command)")
    g.add_argument("--log-level", type=log_level, metavar="LEVEL", default=argparse.SUPPRESS,
                   help=f"one of {', '.join(LOG_LEVELS)} (as before the command)")


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
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed: run's resume hint repeats it
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
    except Interrupted as e:
        return 128 + e.signum
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
