"""The Batch API's audit trail (issue 35): every create, cancel, retry, download and delete, with the
key id, tenant, route, target and outcome, in a capped stream (``cdr:audit``, about AUDIT_MAXLEN
entries: XADD MAXLEN ~) that ``conductor audit`` reads, and in the log. No FastAPI here: the CLI
reads the stream without the serve extra."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str

log = logging.getLogger("conductor.audit")
AUDIT_MAXLEN = 100_000

# (method, path pattern, action); the pattern's group is the target's id
ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"/v1/files"), "file.create"),
    ("DELETE", re.compile(r"/v1/files/([^/]+)"), "file.delete"),
    ("GET", re.compile(r"/v1/files/([^/]+)/content"), "file.download"),
    ("POST", re.compile(r"/v1/batches"), "batch.create"),
    ("POST", re.compile(r"/v1/batches/([^/]+)/cancel"), "batch.cancel"),
    ("POST", re.compile(r"/v1/batches/([^/]+)/retry"), "batch.retry"),
]


def action_of(method: str, path: str) -> tuple[str, str] | None:
    """(action, target id from the path: '' for a create) of an audited request, else None."""
    for m, pattern, action in ROUTES:
        if m == method and (got := pattern.fullmatch(path)):
            return action, got.group(1) if got.groups() else ""
    return None


def record(r: redis.Redis, *, key_id: str, tenant: str, action: str, route: str, target: str, status: int,
           code: str = "") -> None:
    outcome = "ok" if status < 400 else "refused"
    fields = {"ts": f"{time.time():.3f}", "key": key_id, "tenant": tenant, "action": action, "route": route,
              "target": target[:200], "status": str(status), "outcome": outcome, "code": code}
    log.info("audit: %s %s key=%s tenant=%s target=%s status=%d%s", action, route, key_id, tenant, target or "-",
             status, f" code={code}" if code else "")
    r.xadd(K.AUDIT_KEY, fields, maxlen=AUDIT_MAXLEN, approximate=True)  # type: ignore[arg-type]  # str fields


def read(r: redis.Redis, tenant: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """The newest ``limit`` records (of ``tenant`` when given), oldest first. With a tenant the
    stream is read back in pages until ``limit`` of its records are found (or it ends)."""
    out: list[dict[str, Any]] = []
    top = "+"
    while len(out) < limit:
        page: list[tuple[bytes, dict[bytes, bytes]]] = r.xrevrange(  # type: ignore[assignment]  # not None here
            K.AUDIT_KEY, max=top, count=1000)
        for entry_id, raw in page:
            row = {"id": as_str(entry_id), **{as_str(k): as_str(v) for k, v in raw.items()}}
            if tenant is None or row.get("tenant") == tenant:
                out.append(row)
                if len(out) >= limit:
                    break
        if len(page) < 1000:
            break
        top = "(" + as_str(page[-1][0])
    return out[::-1]


def render(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no audit records"
    lines = [f"{'time (UTC)':<20} {'key':<14} {'tenant':<16} {'action':<14} {'status':>6}  route -> target"]
    for x in rows:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(x.get("ts") or 0)))
        code = f" ({x['code']})" if x.get("code") else ""
        lines.append(f"{at:<20} {x.get('key', ''):<14} {x.get('tenant', ''):<16} {x.get('action', ''):<14} "
                     f"{x.get('status', ''):>6}  {x.get('route', '')} -> {x.get('target') or '-'}{code}")
    return "\n".join(lines)
