"""``conductor verify-job`` (the job ledger, conductor/jobs/job_ledger.py) and ``conductor retry``
(conductor/intake/retry.py): every input line of a job against its answers, and the lines that want
another run as a new job. Kept apart from cli/main.py, which only calls in."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    v = command("verify-job", "check every input line of a job against its answers (completed, failed, cancelled, "
                "expired, pending); exit 1 on a line with no answer (job ended) or two", cmd_verify_job)
    v.add_argument("job", help="job id (conductor jobs lists them)")
    _input_flags(v)
    v.add_argument("--json", action="store_true", help="the ledger as one JSON object")
    r = command("retry", "submit a job's cancelled, expired or failed lines as a new job, from its kept input; "
                         f"the chosen lines are kept for the new job's ledger and retry as "
                         f"{_shown_dir()}/retries/NEW.jsonl (--data-dir DIR: DIR/retries/NEW.jsonl), said when "
                         "written", cmd_retry)
    r.add_argument("job", help="the job that ended (conductor jobs lists them)")
    r.add_argument("--job", dest="new_job", required=True, metavar="NEW", help="the new job's id")
    r.add_argument("--only", metavar="KINDS",
                   help="a comma-separated subset of cancelled,expired,failed (default: all)")
    r.add_argument("--include-permanent", action="store_true",
                   help="also retry lines failed for a permanent reason (input_too_long)")
    _input_flags(r)


def _input_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", metavar="FILE", help="the file the job was submitted from (default: the batch's "
                                                   "uploaded file, or the file conductor submit recorded)")
    p.add_argument("--data-dir", metavar="DIR", help="conductor serve's --data-dir, where a batch's uploaded file "
                                                     "and a retry's input (retries/) are kept (default: "
                                                     f"{_shown_dir()})")


def _shown_dir() -> str:
    """The default data directory as the help shows it (the home folder as ~)."""
    from conductor.api.upload_store import default_dir
    home = os.path.expanduser("~")
    shown = str(default_dir())
    return "~" + shown[len(home):] if home != "/" and shown.startswith(home + os.sep) else shown


def kept_input(c: Conductor, job: str, args: argparse.Namespace) -> str | None:
    """``--input``, else the batch's uploaded file, else the file a CLI submit recorded."""
    if args.input:
        if not os.path.isfile(args.input):
            raise ConductorError(f"--input: no such file: {args.input}")
        return str(args.input)
    from conductor.api.upload_store import FileStore, default_dir
    file_id = as_str(c.r.hget(K.job_meta_key(job), "input_file_id"), absent="")
    if file_id:
        root = Path(args.data_dir) if args.data_dir else default_dir()
        path = FileStore(c.r, root).path(file_id) if root.is_dir() else None  # (a FileStore makes its root)
        return str(path) if path is not None and path.exists() else None
    from conductor.jobs.job_ledger import kept_input as recorded
    path_s = recorded(c, job)
    return path_s if path_s and os.path.isfile(path_s) else None


def _known(c: Conductor, job: str) -> None:
    if not c.job_models(job) and not c.r.exists(K.job_meta_key(job)):
        raise ConductorError(f"job {job!r} is unknown to this Redis (conductor jobs lists the jobs)")


def cmd_verify_job(args: argparse.Namespace) -> int:
    from conductor.cli.connect import conductor_from
    from conductor.jobs.job_ledger import build
    c = conductor_from(args)
    _known(c, args.job)
    led = build(c, args.job, kept_input(c, args.job, args))
    print(json.dumps(led.to_json()) if args.json else led.render(), flush=True)
    return 0 if led.clean else 1


def cmd_retry(args: argparse.Namespace) -> int:
    from conductor.cli.connect import conductor_from
    from conductor.intake import retry
    try:
        only = retry.parse_only(args.only)
    except BadInput as e:
        raise ConductorError(str(e)) from None
    c = conductor_from(args)
    if c.r.zscore(K.JOBS_KEY, args.new_job) is not None or c.r.exists(K.job_meta_key(args.new_job)):
        raise ConductorError(f"--job: job {args.new_job!r} exists already: name a new one")
    source = kept_input(c, args.job, args)
    p = retry.plan(c, args.job, source, only, args.include_permanent)
    print(p.render(), file=sys.stderr)
    if not p.ids:
        print(f"nothing to retry in job {args.job}", file=sys.stderr)
        return 0
    path = retry_file(args.data_dir, args.new_job)
    accepted = retry.submit(c, args.job, args.new_job, str(source), p, str(path))
    print(args.new_job)
    print(f"submitted {accepted} items to job {args.new_job} (retry of {args.job}); its input is kept in {path} "
          "for its ledger and retry (remove it once the job is done with)", file=sys.stderr)
    return 0


def retry_file(data_dir: str | None, job: str) -> Path:
    """Where a retry's input is kept, beside serve's uploads: the new job's ledger reads it."""
    from conductor.api.upload_store import default_dir
    root = (Path(data_dir) if data_dir else default_dir()) / "retries"
    root.mkdir(parents=True, exist_ok=True)
    return root / (job.replace("/", "_") + ".jsonl")  # a job name may hold '/'; a file name may not


INSPECT_JOBS = 100  # the newest jobs whose ledgers ``inspect --verify`` checks


def verify_jobs_in_flight(c: Conductor, models: list[str]) -> int:
    """``inspect --verify``: the ledger of each job in flight on ``models`` (the newest
    INSPECT_JOBS jobs), one paragraph each; 1 when one has a line answered twice or an answer to no
    input line (a line with no answer yet is pending, not a finding, while the job runs)."""
    from conductor.jobs.job_ledger import build
    from conductor.jobs.job_list import list_jobs
    from conductor.jobs.job_state import TERMINAL
    status = 0
    no_input = argparse.Namespace(input=None, data_dir=None)
    for row in list_jobs(c, INSPECT_JOBS):
        if row.state in TERMINAL or not set(row.models) & set(models):
            continue
        led = build(c, row.job, kept_input(c, row.job, no_input))
        print("ledger: " + led.render().replace("\n", "\n  "))
        status = status or (0 if led.clean else 1)
    return status
