"""The job lifecycle and the OpenAI Batch API on the command line: ``submit --completion-window
--metadata``, ``conductor cancel``, ``conductor serve`` (kept apart from cli/main.py, which only calls in)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable

from conductor.cli.args import port
from conductor.client import Conductor
from conductor.errors import BadInput, ConductorError


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


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from conductor.api.app import make_app
    except ImportError as e:
        raise ConductorError(f"conductor serve needs the serve extra (pip install 'conductor[serve]'): {e}") from None
    from conductor.cli.connect import url_from
    keys = list(args.api_key) + [k for k in os.environ.get("CONDUCTOR_API_KEYS", "").split(",") if k.strip()]
    from conductor.tier.object_store import store_from
    app = make_app(url_from(args), data_dir=args.data_dir, api_keys=[k.strip() for k in keys],
                   segment_store=store_from(getattr(args, "store", None)))
    print(f"conductor serve: http://{args.host}:{args.port}/v1 (files in {app.state.store.root})", file=sys.stderr,
          flush=True)
    # uvicorn re-raises a signal it stopped on once it has shut down, under the handler it found
    # installed: a SIGTERM is a clean stop (status 0, as for the worker and the exporter), and one
    # that comes before uvicorn takes the signal over stops serve at once, as cleanly.
    signal.signal(signal.SIGTERM, _stop_cleanly)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _stop_cleanly(_sig: int, _frame: object) -> None:
    raise SystemExit(0)


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    c = command("cancel", "cancel a job: waiting items get a 'cancelled' result, in-flight batches finish",
                cmd_cancel)
    c.add_argument("job", help="job id (conductor jobs lists them)")
    c.add_argument("--json", action="store_true", help="the job's lifecycle as one JSON object")
    command("expire", "end every job whose completion window has passed (conductor serve does this by itself)",
            cmd_expire)
    s = command("serve", "serve OpenAI's Files and Batches API at /v1 and a status page at /", cmd_serve)
    s.add_argument("--port", type=port, default=8000, help="TCP port")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a bearer token clients must send (repeatable; also env CONDUCTOR_API_KEYS, comma separated; "
                        "none: no authentication)")
    s.add_argument("--data-dir", metavar="DIR",
                   help="where uploaded file bytes are kept (shared by every replica; default: "
                        "$XDG_DATA_HOME/conductor/files or ~/.local/share/conductor/files)")
