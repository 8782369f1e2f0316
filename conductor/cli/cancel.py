"""The end of a job on the command line: ``conductor cancel`` and ``conductor expire`` (the job
lifecycle: conductor/jobs/job_state.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable


def cmd_cancel(args: argparse.Namespace) -> int:
    from conductor.cli.connect import conductor_from
    from conductor.jobs.job_state import cancel, render
    c = conductor_from(args)
    d = cancel(c, args.job)
    print(json.dumps(d) if args.json else render(d), flush=True)
    return 0


def cmd_expire(args: argparse.Namespace) -> int:
    from conductor.cli.connect import conductor_from
    from conductor.jobs.job_state import expire_due
    for job in expire_due(conductor_from(args)):
        print(job)
    return 0


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    c = command("cancel", "cancel a job: waiting items get a 'cancelled' result, in-flight batches finish",
                cmd_cancel)
    c.add_argument("job", help="job id (conductor jobs lists them)")
    c.add_argument("--json", action="store_true", help="the job's lifecycle as one JSON object")
    command("expire", "end every job whose completion window has passed (conductor serve does this by itself)",
            cmd_expire)
