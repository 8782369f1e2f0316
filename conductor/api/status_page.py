"""The status page of ``conductor serve`` (``/``): jobs with state, progress, rate and ETA; models
with waiting tokens and live workers; dead letters. Plain HTML, refreshed by a meta tag, no script."""

from __future__ import annotations

import html
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from conductor.client import Conductor
from conductor.jobs import job_state
from conductor.jobs.job_list import list_jobs
from conductor.redis_contract import keys as K

_STYLE = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.5em}"
          "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child,th:first-child"
          "{text-align:left}progress{width:10em}")


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _table(head: list[str], rows: list[list[str]], row_ids: list[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        rid = f' id="{_e(row_ids[i])}"' if row_ids else ""
        out.append(f"<tr{rid}>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>")
    if not rows:
        out.append(f'<tr><td colspan="{len(head)}">none</td></tr>')
    return "".join(out) + "</table>"


def render_page(c: Conductor, jobs: int = 50) -> str:
    now = time.time()
    job_rows, job_ids = [], []
    for row in reversed(list_jobs(c, jobs)):
        d = job_state.describe(c, row.job, advance=False)
        answered = row.completed + row.failed
        started = d.get("in_progress_at") or row.created_ms / 1000
        rate = answered / max(now - started, 1e-3) if d["status"] == "in_progress" and answered else None
        eta = f"{row.pending / rate:,.0f} s" if rate else "-"
        job_ids.append(f"job-{row.job}")
        job_rows.append([_e(row.job), _e(d["status"]),
                         f'<progress max="{max(row.submitted, 1)}" value="{answered}"></progress> '
                         f"{answered:,}/{row.submitted:,}",
                         f"{row.failed:,}", f"{rate:,.1f}/s" if rate else "-", _e(eta)])
    model_rows, dead_rows = [], []
    for model in sorted(c.models()):
        mk = K.ModelKeys(model)
        st = c.r.hmget(mk.intake, "tokens", "items")
        live = sum(1 for w in c.r.hkeys(mk.workers) if c.r.exists(mk.heartbeat(w.decode() if isinstance(w, bytes)
                                                                                 else w)))
        model_rows.append([_e(model), f"{int(st[1] or 0):,}", f"{int(st[0] or 0):,}", f"{live}"])
        dead = c.r.xlen(mk.dead)
        if dead:
            dead_rows.append([_e(model), f"{dead:,}"])
    return (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">'
            f"<title>conductor</title><style>{_STYLE}</style></head><body><h1>conductor</h1>"
            f"<h2>Jobs</h2>{_table(['job', 'state', 'progress', 'failed', 'rate', 'ETA'], job_rows, job_ids)}"
            f"<h2>Models</h2>{_table(['model', 'waiting items', 'waiting tokens', 'live workers'], model_rows)}"
            f"<h2>Dead letters</h2>{_table(['model', 'items'], dead_rows)}"
            f"<p>{time.strftime('%Y-%m-%d %H:%M:%S')}</p></body></html>")


def status_router(c: Conductor) -> APIRouter:
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse)
    def status_page() -> str:
        return render_page(c)

    return router
