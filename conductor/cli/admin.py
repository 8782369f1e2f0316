"""The operator's commands: ``migrate``, ``config``, ``pause``/``resume``, ``reclaim``,
``trim-results`` and ``dead-letter``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from conductor.cli.connect import conductor_from, url_from
from conductor.errors import ConductorError, did_you_mean
from conductor.redis_contract import keys as K

if TYPE_CHECKING:
    from conductor.client import Conductor


def cmd_migrate(args: argparse.Namespace) -> int:
    from conductor.client import connect
    from conductor.redis_contract.schema import current, migrate
    r = connect(url_from(args))
    applied = migrate(r)
    print(f"schema {current(r)}" + (f" (applied {applied})" if applied else " (up to date)"))
    return 0


def known_model(c: Conductor, model: str, create: bool | None = False) -> None:
    """A typo would otherwise register a model for good (cdr:models, its config and group), or read
    an empty one and find nothing wrong. ``create`` None: the command cannot make one (a reader)."""
    if create or c.r.sismember(K.MODELS_KEY, model):
        return
    known = c.models()
    shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
    raise ConductorError(f"model {model!r} is unknown to this Redis{did_you_mean(model, known)} "
                         f"(known: {shown or 'none'})" + ("" if create is None else "; --create makes it"))


def cmd_pause(args: argparse.Namespace) -> int:
    c = conductor_from(args)
    known_model(c, args.model, getattr(args, "create", False))
    if args.resume:
        c.resume(args.model)
        print(f"{args.model}: resumed")
    else:
        c.pause(args.model)
        print(f"{args.model}: paused until 'conductor resume {args.model}': every write is refused; workers "
              "wait, producers are refused (submit exits 2, nothing written; submit again after resume)")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from conductor.redis_contract.config import parse_value
    c = conductor_from(args)
    known_model(c, args.model, args.create)
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
        from conductor.redis_contract.config import check_relations
        try:
            check_relations(c.config(args.model), values)
        except ValueError as e:
            raise ConductorError(str(e)) from None
        c.set_config(args.model, values)
    # Showing writes nothing (a reader or producer may look): an unset threshold shows its default.
    from conductor.redis_contract.config import DEFAULTS
    shown = {k: str(v) for k, v in DEFAULTS.items()} | c.config(args.model)
    for k, v in sorted(shown.items()):
        print(f"{k} = {v}")
    return 0


def cmd_dead_letter(args: argparse.Namespace) -> int:
    from conductor.jobs.deadletter import DeadLetter
    dl = DeadLetter(conductor_from(args))
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
    c = conductor_from(args)
    print(json.dumps(c.reclaim_dead(args.model, min_idle_ms=args.min_idle_ms)))
    return 0


def cmd_trim_results(args: argparse.Namespace) -> int:
    """Retention: drop a finished job's results older than --older-than-s (readers had their time)."""
    from conductor.jobs.retention import trim_job_results
    c = conductor_from(args)
    if not c.job_models(args.job):
        raise ConductorError(f"job {args.job!r} is unknown to this Redis")
    try:
        n = trim_job_results(c, args.job, int((time.time() - args.older_than_s) * 1000))
    except Exception as e:  # noqa: BLE001 - the script's refusal (work left) is one line for the operator
        raise ConductorError(f"trim-results: {e}") from None
    print(f"trimmed {n} result records of job {args.job}")
    return 0


def cmd_tenant(args: argparse.Namespace) -> int:
    from conductor.errors import BadInput
    from conductor.jobs import tenant_limits
    from conductor.jobs.tenants import render, set_weight, tenant_rows
    if not args.tenant.strip():
        raise ConductorError("tenant: a name is needed (a job without --tenant is its own tenant, weight 1; "
                             "conductor tenants lists them as one row)")
    c = conductor_from(args)
    limits = {n: getattr(args, n, None) for n in tenant_limits.NAMES}
    try:
        if args.weight is not None:
            set_weight(c, args.tenant, args.weight)
        if any(v is not None for v in limits.values()):
            tenant_limits.set_limits(c.r, args.tenant, **limits)
    except BadInput as e:
        raise ConductorError(str(e)) from None
    rows = [r for m in c.models() for r in tenant_rows(c, m) if r.tenant == args.tenant]
    print(render(rows) if rows else f"tenant {args.tenant}: weight {args.weight if args.weight is not None else 1:g}, "
          "nothing served or waiting yet")
    print(tenant_limits.render(tenant_limits.usage(c.r, [args.tenant])))
    return 0


def cmd_tenants(args: argparse.Namespace) -> int:
    from conductor.jobs.tenants import render, tenant_rows
    c = conductor_from(args)
    from conductor.jobs import tenant_limits
    if args.limits:  # the Batch API's use against each tenant's limits alone
        use = tenant_limits.usage(c.r)
        print(json.dumps([u.as_dict() for u in use]) if args.json else tenant_limits.render(use))
        return 0
    rows = [r for m in ([args.model] if args.model else c.models()) for r in tenant_rows(c, m)]
    print(json.dumps([r.as_dict() for r in rows]) if args.json else render(rows))
    if not args.json and (use := tenant_limits.usage(c.r)):  # (a fleet without API keys or limits: no table)
        print()
        print(tenant_limits.render(use))
    return 0
