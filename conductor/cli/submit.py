"""``conductor submit``: a JSONL or Parquet file of items into a job (conductor/intake/file_intake.py
reads it in passes). A job that exists is refused unless ``--resume`` (as ``run`` refuses it);
a resume is idempotent: ids already there are skipped, and a submit that adds nothing says so
plainly. (``conductor run``: cli/run.py.)"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from conductor.cli.connect import conductor_from
from conductor.cli.output import Output, refuse_overwrite
from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError
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
                                                      "time; a past one is refused): within a tenant the job due "
                                                      "first goes first, and conductor jobs and status report one "
                                                      "past it")


def add_submit_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--completion-window", metavar="WINDOW",
                   help="end the job as expired when it is not done this long after submit (24h, 90m, 7d; "
                        "default: never). Expiry is acted on by conductor serve or the next conductor cancel/expire")
    s.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                   help="a metadata pair kept with the job (conductor status shows it); repeatable, at most 16")


def start_job(c: Conductor, job: str, args: argparse.Namespace) -> None:
    from conductor.jobs.job_state import check_metadata, parse_window, start
    try:
        window_s = parse_window(args.completion_window, "--completion-window") if args.completion_window else None
        pairs = [m.split("=", 1) for m in args.metadata]
        if any(len(p) != 2 for p in pairs):
            raise BadInput("--metadata", "must be KEY=VALUE")
        meta = check_metadata(dict(pairs), "--metadata")
    except BadInput as e:
        raise ConductorError(str(e)) from None
    start(c.r, job, window_s=window_s, window=args.completion_window, metadata=meta)


def job_class(args: argparse.Namespace, c: Any = None, job: str = "") -> JobClass:
    """The class the flags give; with ``c`` and ``job``, a deadline already past refused for a new
    job: a job due before it exists is a mistyped date, not a request (issue 37). A job that exists
    keeps the class it was made with (job_class.lua), so running its submit again still passes."""
    import time

    from conductor.errors import BadInput
    from conductor.jobs.job_class import parse_deadline
    try:
        cls = JobClass(args.tenant, args.priority, parse_deadline(args.deadline, "--deadline"))
    except BadInput as e:
        raise ConductorError(str(e)) from None
    late_s = time.time() - cls.deadline_ms / 1000
    if c is not None and cls.deadline_ms and late_s > 0:
        from conductor.jobs.job_state import ago
        from conductor.redis_contract import keys as K
        if c.r.zscore(K.JOBS_KEY, job) is None:
            raise ConductorError(f"--deadline: {args.deadline} is {ago(late_s)} in the past, so job {job} would be "
                                 "late before it starts; give when it is due (1h, 2d, or a future ISO 8601 time)")
    return cls


@contextmanager
def rejects_output(path: str | None) -> Iterator[Output | None]:
    """The --rejects file: complete (moved into place) once the file is checked, also when the
    check refuses the file (that is when it is read); left as it was if the check is cut short."""
    if not path:
        yield None
        return
    out = Output(path)
    try:
        yield out
    except ConductorError:
        out.commit()
        raise
    except BaseException:
        out.discard()
        raise
    out.commit()


def cmd_submit(args: argparse.Namespace) -> int:
    from conductor.cli.progress import ProgressLine
    from conductor.intake.file_intake import LARGE_SUBMIT, KnownModels, check_file, prepare_job
    from conductor.intake.intake_run import Defaults, run
    from conductor.intake.intake_task import Task, cli_owner, create, file_identity
    conductors: list[Any] = []  # connected only when a line needs a model's default (or to submit)

    def redis_client() -> Any:
        if not conductors:
            conductors.append(conductor_from(args))
        return conductors[0].r
    def known_models() -> list[str]:
        redis_client()
        models: list[str] = conductors[0].models()
        return models
    refuse_overwrite([args.file], {"--rejects": args.rejects})
    defaults = Defaults(redis_client, None)  # recorded with the task: a resumed intake builds the same items
    # a model Redis does not know is a typo unless --create says it is new (a fleet not started yet)
    known = None if args.create else KnownModels(known_models)
    with rejects_output(args.rejects) as rej:
        found = check_file(args.file, skip_invalid=args.skip_invalid, rejects=rej, default_max_tokens=defaults,
                           check=known)
    redis_client()
    c = conductors[0]
    job = args.job or default_job(args.file)
    refuse_existing(c, job, args.resume)
    cls = job_class(args, c, job)
    prepare_job(c, found, job, cls)  # nothing is written when any part of the file would be refused
    # From here the intake is a task in Redis (conductor/intake/intake_task.py): killed, this command's
    # intake is resumed from its cursor by conductor serve or a worker's maintenance (docs/durability.md).
    size, mtime_ns = file_identity(args.file)
    owner = cli_owner()
    create(c, Task(job=job, source="cli", path=str(Path(args.file).resolve()), state="sending",
                   skip_invalid=args.skip_invalid, job_class=cls, defaults=dict(defaults.seen), size=size,
                   mtime_ns=mtime_ns), owner)
    start_job(c, job, args)
    record_input(c, job, args.file)
    live = sys.stderr.isatty() and found.items >= LARGE_SUBMIT and not args.quiet
    with ProgressLine(f"submit {job}", found.items, sys.stderr, live=live) as line:
        sent = run(c, job, owner, found, defaults, progress=None if args.quiet else line.update)
    print(job)
    if sent.state == "stopped":
        print(f"job {job} ended ({_reason(c, job)}) while it was submitted: its intake stopped after "
              f"{sent.accepted + sent.duplicates} of {found.items} items", file=sys.stderr)
    elif sent.state != "done":
        print(f"job {job}: intake {sent.state} after {sent.accepted + sent.duplicates} of {found.items} items; "
              "it is resumed from its cursor by conductor serve or a worker's maintenance", file=sys.stderr)
        return 1
    elif args.quiet:
        pass
    elif sent.accepted == 0:
        print(f"submitted 0 items ({sent.duplicates} already there) to job {job}: nothing new, every item of "
              f"{args.file} was already in it", file=sys.stderr)
    else:
        print(f"submitted {sent.accepted} items ({sent.duplicates} already there) to job {job}", file=sys.stderr)
    return 0


def refuse_existing(c: Any, job: str, resume: bool) -> None:
    """A job name this Redis knows is added to only when asked (``--resume``), as ``run`` does: a name
    reused by accident (the default, a file's stem) would otherwise merge two inputs into one job."""
    from conductor.redis_contract import keys as K
    if resume or c.r.zscore(K.JOBS_KEY, job) is None:
        return
    st = c.status(job)
    raise ConductorError(f"job {job} exists in this Redis ({st['submitted']} items, {st['completed'] + st['failed']} "
                         "answered): --resume adds what it lacks (ids it has are skipped), --job NEW starts a fresh "
                         "one; nothing submitted")


def record_input(c: Any, job: str, path: str) -> None:
    """The file a job is made from, for its ledger and its retry (conductor/cli/retry.py); a job
    made from several files keeps none ('': its ledger reads the ids Redis holds)."""
    from conductor.redis_contract import keys as K
    from conductor.redis_contract.connection import as_str
    key = K.job_meta_key(job)
    full = str(Path(path).resolve())
    kept = c.r.hget(key, "input_path")
    if kept is None:
        c.r.hset(key, "input_path", full)
    elif as_str(kept) != full:
        c.r.hset(key, "input_path", "")


def _reason(c: Any, job: str) -> str:
    from conductor.intake.intake_task import read
    task = read(c.r, job)
    return task.reason if task and task.reason else "ended"
