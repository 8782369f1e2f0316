"""``conductor inspect --verify [--repair]``: the rows as a table or JSON, and the exit status."""

from __future__ import annotations

import json
from typing import Any

import redis

from conductor.tier.object_store import Store
from conductor.verify.checks import Report, verify, verify_confirmed
from conductor.verify.repair import repair
from conductor.verify.tier_truth import repair_store

_ALWAYS_SHOWN = ("state.", "inst.", "staged.", "job.", "batches.")  # lane-level rows only when they differ


def render(report: Report, *, show_all: bool = False) -> str:
    """Each counter next to its truth; lane-level rows only where they differ unless ``show_all``."""
    drift = report.drift
    out = [f"model {report.model}: {len(report.rows)} counters checked, {len(drift)} differ"
           + (f", {len(report.problems)} ledger finding(s)" if report.problems else "")]
    shown = [r for r in report.rows if show_all or r.diff or r.kind.startswith(_ALWAYS_SHOWN)]
    hidden = len(report.rows) - len(shown)
    if shown:
        wk = max(len(r.key) for r in shown)
        wf = max(len(r.field) for r in shown)
        out.append(f"  {'key':<{wk}}  {'field':<{wf}}  {'recorded':>10}  {'truth':>10}  {'diff':>8}")
        for r in shown:
            mark = "  <-- differs" if r.diff else ""
            out.append(f"  {r.key:<{wk}}  {r.field:<{wf}}  {r.recorded:>10}  {r.truth:>10}  {r.diff:>+8}{mark}")
    if hidden:
        out.append(f"  ({hidden} lane-level counters agree with the truth; --all lists them)")
    out.extend(f"  ledger: {p}" for p in report.problems)
    out.extend(f"  note: {n}" for n in report.notes)
    return "\n".join(out)


def cli_verify(r: redis.Redis, models: list[str], *, do_repair: bool = False, show_all: bool = False,
               ledger: bool = True, as_json: bool = False, store: Store | None = None) -> int:
    """``conductor inspect --verify [--repair]``: 0 when every counter equals its truth, else 1.

    A row that differs, or a ledger finding, is read again by a second pass (verify_confirmed) and
    counts only when that pass finds the same: on a live system one pass can catch a submit between
    two of its reads (a job created after the pass listed the model's jobs).

    With ``do_repair`` the counters that differ are rewritten, the changes printed, and the
    exit status tells whether a second verification found everything equal. ``store``: the disk
    tier's, whose segment files are then checked (and a lost segment's items answered on repair).
    """

    status = 0
    docs = []
    for model in models:
        report = verify_confirmed(r, model, items=ledger, store=store)
        doc: dict[str, Any] = {"model": model, "rows": [dict(key=x.key, field=x.field, recorded=x.recorded,
                                                             truth=x.truth, diff=x.diff, kind=x.kind)
                                                        for x in report.rows if show_all or x.diff],
                               "checked": len(report.rows), "differ": len(report.drift),
                               "problems": report.problems, "notes": report.notes}
        if not as_json:
            print(render(report, show_all=show_all))
        if do_repair and not report.ok:
            answered = repair_store(r, model, store)
            changes, failed = repair(r, model)
            after = verify(r, model, items=ledger, store=store)
            doc.update(store_repairs=answered, changes=[c.__dict__ for c in changes], repair_failed=failed,
                       after_differ=len(after.drift), after_problems=after.problems)
            if not as_json:
                for line in answered:
                    print(f"repair of {model}: {line}")
                print(f"repair of {model}: {len(changes)} change(s)")
                for c in changes:
                    print(f"  {c.key}  {c.field}: {c.old or '(absent)'} -> {c.new or '(absent)'}")
                for f in failed:
                    print(f"  not repaired: {f}")
                print(f"after repair: {len(after.drift)} counter(s) differ"
                      + (f", {len(after.problems)} ledger finding(s) a repair cannot settle"
                         if after.problems else ""))
                for x in after.drift:
                    print(f"  {x.key}  {x.field}: recorded {x.recorded}, truth {x.truth}")
            report = after
        if not report.ok:
            status = 1
        docs.append(doc)
    if as_json:
        print(json.dumps(docs))
    elif not models:
        print("no models")
    return status
