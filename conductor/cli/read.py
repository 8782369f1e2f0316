"""The read commands: ``results``, ``status``, ``jobs``, ``inspect`` (with ``--verify
[--repair]``) and the ``exporter``; none writes, so a reader's credentials do."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from conductor.cli.connect import conductor_from, url_from
from conductor.cli.output import Output, refuse_overwrite
from conductor.errors import ConductorError
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.shards import fold

if TYPE_CHECKING:
    from conductor.client import Conductor


def known_job(c: Conductor, job: str) -> list[str]:
    """The job's models; an unknown job is an error (a typo would otherwise read nothing, or
    follow forever)."""
    models = c.job_models(job)
    if not models:
        from conductor.errors import did_you_mean
        from conductor.redis_contract import keys as K
        recent = [as_str(j) for j in c.r.zrevrange(K.JOBS_KEY, 0, 999)]
        raise ConductorError(f"job {job!r} is unknown to this Redis{did_you_mean(job, recent)} "
                             "(conductor jobs lists them)")
    return models


def cmd_results(args: argparse.Namespace) -> int:
    from conductor.cli.no_worker_hint import NoWorkerHint
    from conductor.client.rewind import REWIND_WINDOW, Rewind
    c = conductor_from(args)
    models = known_job(c, args.job)
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
    refuse_overwrite([], {"-o": args.output, "--errors": args.errors})
    out = Output(args.output)
    errors = Output(args.errors) if args.errors else None
    try:
        _write(c.results(args.job, follow=args.follow, should_stop=waiting, on_rewind=rewound), args, out, errors, c)
    except BaseException:
        out.discard()  # an interrupted read leaves an earlier file as it was, never a truncated one
        if errors is not None:
            errors.discard()
        raise
    out.commit()
    if errors is not None:
        errors.commit()
    if not args.follow:
        st = c.status(args.job)
        if st["pending"]:
            print(f"conductor: job {args.job} is still running: {st['pending']} of {st['submitted']} items have "
                  "no result yet (--follow waits for them)", file=sys.stderr)
    return 1 if rewinds else 0


def _write(records: Iterator[bytes], args: argparse.Namespace, out: Output, errors: Output | None,
           c: Conductor | None = None) -> None:
    if args.format == "openai":
        from conductor.formats.openai_output import write_openai
        answered: set[str] = set()
        write_openai(_noting(records, answered), out, errors)
        if c is not None:  # lines no result holds: refused at validation, never submitted (conductor verify-job)
            from conductor.jobs.job_ledger import derived_lines, kept_input
            path = kept_input(c, args.job)
            for line in derived_lines(c, args.job, path, answered) if path else ():
                (errors or out).write(json.dumps(line).encode() + b"\n")
        return
    for rec in records:
        out.write(rec + b"\n")
        if args.follow:
            out.flush()


def _noting(records: Iterator[bytes], answered: set[str]) -> Iterator[bytes]:
    """The records as they come, each one's item id noted in ``answered``."""
    from conductor.jobs.job_ledger import answers
    for rec in records:
        answered.update(answers([rec]))
        yield rec


def _status_line(st: dict[str, Any]) -> str:
    """The items and how each was answered, in the first line's words (failed: not a cancel's or an
    expiry's answer, which are said as cancelled and expired when there are any)."""
    from conductor.jobs.job_state import item_answers
    it = item_answers(st)
    ended = "".join(f", {k} {it[k]}" for k in ("cancelled", "expired") if it[k])
    return (f"job {st['job']}: submitted {it['submitted']}, completed {it['completed']}, failed {it['failed']}"
            f"{ended}, pending {it['pending']}" + (f", lost {st['lost']}" if st.get("lost") else ""))


def _unclean(st: dict[str, Any]) -> bool:
    """An ended job that is not clean (exit 1): items failed, or expired before they ran; a cancel is
    what its user asked for, not a failure."""
    from conductor.jobs.job_state import item_answers
    it = item_answers(st)
    return bool(it["failed"] or it["expired"])


def folded_rows(rows: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per-model counters with a sharded model's shards summed under its name (shards.py)."""
    out: dict[str, dict[str, int]] = {}
    for model, row in rows.items():
        into = out.setdefault(fold(model), dict.fromkeys(row, 0))
        for k, v in row.items():
            into[k] = into.get(k, 0) + v
    for row in out.values():
        if "lost" in row:
            row["lost"] = max(0, row.get("declared", 0) - row.get("submitted", 0))
    return out


def _with_lines(c: Conductor, job: str, st: dict[str, Any]) -> dict[str, Any]:
    """The item counters in ``status``'s words (failed, cancelled and expired apart), with the input
    lines (``lines``: None where the input is not known), the request counts as ``conductor verify-job``
    and the Batch API count them (OpenAI's: a cancelled line is failed there), and the job's class."""
    from conductor.jobs.job_state import describe, item_answers, past_deadline
    d = describe(c, job, advance=False)
    deadline = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d["deadline_ms"] / 1000)) if d["deadline_ms"] \
        else None
    return {**st, "models": folded_rows(st["models"]), **item_answers(st), "lines": d["lines"],
            "request_counts": d["request_counts"],
            "status": d["status"], "tenant": d["tenant"], "priority": d["priority"], "deadline": deadline,
            "deadline_ms": d["deadline_ms"], "past_deadline": past_deadline(d["deadline_ms"], d["status"])}


def cmd_status(args: argparse.Namespace) -> int:
    from conductor.cli.no_worker_hint import NoWorkerHint
    from conductor.cli.progress import ProgressLine, Rate, fmt_eta
    c = conductor_from(args)
    models = known_job(c, args.job)
    st = c.status(args.job, models)
    if not args.watch and not args.json:
        from conductor.jobs.job_state import describe, render
        print(render(describe(c, args.job, advance=False)), flush=True)  # read only: a reader may not write
    if not args.watch or args.json:
        while True:
            print(json.dumps(_with_lines(c, args.job, st)) if args.json else _status_line(st), flush=True)
            if st["lost"] and (not args.watch or st["done"]):
                return _lost(args.job, st)
            if not args.watch:
                return 0
            if st["done"]:
                return 1 if _unclean(st) else 0
            time.sleep(args.interval)
            st = c.status(args.job, c.job_models(args.job))  # a later submit may have added a model
    hint = NoWorkerHint(c.r, models)
    if sys.stdout.isatty():
        with ProgressLine(f"job {args.job}", st["submitted"], sys.stdout, unit="answered") as line:
            while not st["done"]:
                hint.check(c.job_models(args.job))
                line.update(st["completed"] + st["failed"], st["submitted"], note=_note(st))
                time.sleep(args.interval)
                st = c.status(args.job, c.job_models(args.job))
            line.update(st["completed"] + st["failed"], st["submitted"], note=_note(st))
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
    return 1 if _unclean(st) else 0


def _note(st: dict[str, Any]) -> str:
    from conductor.jobs.job_state import item_answers
    it = item_answers(st)
    return ", ".join(f"{it[k]} {k}" for k in ("failed", "cancelled", "expired") if it[k] or k == "failed")


def _lost(job: str, st: dict[str, Any]) -> int:
    print(f"conductor: {st['lost']} item(s) the producer sent to job {job} are missing from this Redis "
          f"(declared {st['declared']}, present {st['submitted']}): a failover to a replica that had not "
          "received them, or a submit that stopped halfway. Submit the same file again with the same "
          "--job and --resume: submission is idempotent, only the missing items are added.", file=sys.stderr)
    return 3


def cmd_jobs(args: argparse.Namespace) -> int:
    from conductor.jobs.job_list import list_jobs, render
    rows = list_jobs(conductor_from(args), limit=args.limit or None)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows]))
    else:
        print(render(rows))
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    from conductor.observability.exporter import serve
    return serve(url_from(args), args.port, args.host, starving_s=args.starving_s, top_shapes=args.top_shapes,
                 jobs=args.jobs)


def cmd_inspect(args: argparse.Namespace) -> int:
    from conductor.observability.model_view import model_overview, render
    c = conductor_from(args)
    if args.model:
        from conductor.cli.admin import known_model
        known_model(c, args.model, create=None)
    models = c.shards(args.model) if args.model else c.models()  # a sharded model: each of its shards
    if args.verify or args.repair:
        from conductor.verify import cli_verify
        status = cli_verify(c.r, models, do_repair=args.repair, show_all=args.all, ledger=not args.no_ledger,
                            as_json=args.json, store=c.tier.store if c.tier else None)
        if args.json or args.no_ledger:
            return status
        from conductor.cli.retry import verify_jobs_in_flight  # the job ledgers (verify-job) of jobs in flight
        return verify_jobs_in_flight(c, models) or status
    views = [model_overview(c, m, lanes=args.lanes) for m in models]
    if args.json:
        print(json.dumps(views, default=str))
    else:
        print("\n".join(render(v) for v in views) or "no models")
    return 0
