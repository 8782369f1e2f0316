"""Tenants (issue 26): their weights, and what the fleet served each (``conductor tenant``,
``conductor tenants``, the exporter).

A tenant's weight is kept in a global registry (``cdr:tenants``, for the record and for models
made later) and in every model's ``cdr:{M}:tenants``, which claim.lua reads (a script touches one
model's slot). Service is what complete.lua counts per tenant as items get their results: padded
input tokens (``T:in``) and output tokens (``T:out``) in ``cdr:{M}:served``, and the same per ten
seconds in ``cdr:{M}:served10:N`` (kept two minutes) for the last minute's shares. A tenant's
service in one number is ``in + decode_weight x out`` (the model's config; one output token is worth
that many input tokens, as in the fleet's work estimate).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from conductor.client import Conductor
from conductor.errors import BadInput
from conductor.redis_contract import keys as K
from conductor.redis_contract.config import DEFAULTS
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import JobClass

TENANTS_KEY = K.TENANTS_KEY


def set_weight(c: Conductor, tenant: str, weight: float) -> None:
    """The tenant's weight on every model (and in the registry, for models made later)."""
    if not tenant:
        # '' is each job's own tenant in a job's class: no one tenant to weigh
        raise BadInput("tenant", "a name is needed (a job without --tenant is its own tenant, weight 1)")
    JobClass(tenant)  # the name is checked as a job class checks it
    if not (isinstance(weight, float | int) and math.isfinite(weight) and 0.001 <= weight <= 1e6):
        raise BadInput("weight", f"must be a number in 0.001..1000000, got {weight!r}")
    pipe = c.r.pipeline(transaction=False)
    pipe.hset(TENANTS_KEY, tenant, repr(float(weight)))
    for model in c.models():
        pipe.hset(K.ModelKeys(model).tenants, tenant, repr(float(weight)))
    pipe.execute()


@dataclass
class TenantRow:
    tenant: str
    model: str
    weight: float = 1.0
    served_in: int = 0
    served_out: int = 0
    service: float = 0.0  # served_in + decode_weight x served_out
    share_last_minute: float = 0.0  # of the model's service in the last minute
    waiting_tokens: int = 0
    waiting_items: int = 0
    virtual: float = 0.0  # the scheduler's virtual token counter (lua/lib_fair.lua)
    # the one row of the jobs without a tenant (each its own; in batch priority they share the
    # signature's instances, so their waiting work is not told apart by job): tenant None in JSON
    own: bool = False

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        if self.own:
            row["tenant"] = None
        return row


@dataclass
class _Acc:
    rows: dict[str, TenantRow] = field(default_factory=dict)

    def row(self, tenant: str, model: str) -> TenantRow:
        if tenant not in self.rows:
            self.rows[tenant] = TenantRow(tenant, model)
        return self.rows[tenant]


def _pairs(raw: dict[Any, Any]) -> dict[str, tuple[int, int]]:
    """{"T:in": n, "T:out": m} as {T: (n, m)}."""
    out: dict[str, tuple[int, int]] = {}
    for k, v in raw.items():
        name, _, part = as_str(k).rpartition(":")
        i, o = out.get(name, (0, 0))
        out[name] = (i + int(v), o) if part == "in" else (i, o + int(v))
    return out


def tenant_rows(c: Conductor, model: str, now: float | None = None) -> list[TenantRow]:
    """Every tenant the model knows (a weight, service, waiting work or a counter), by name."""
    mk = K.ModelKeys(model)
    tens = int((time.time() if now is None else now) // 10)
    pipe = c.r.pipeline(transaction=False)
    pipe.hget(mk.cfg, "decode_weight")
    pipe.hgetall(mk.tenants)
    pipe.hgetall(mk.served)
    pipe.hgetall(mk.vtc)
    for k in range(6):
        pipe.hgetall(mk.served10(tens - k))
    pipe.zrange(mk.staged, 0, -1)
    pipe.zrange(mk.active, 0, -1)
    got = pipe.execute()
    dw = float(got[0] or DEFAULTS["decode_weight"])
    acc = _Acc()
    for t, w in got[1].items():
        acc.row(as_str(t), model).weight = float(w)
    for t, (i, o) in _pairs(got[2]).items():
        r = acc.row(t, model)
        r.served_in, r.served_out, r.service = i, o, i + dw * o
    for t, v in got[3].items():
        acc.row(as_str(t), model).virtual = float(v)
    minute: dict[str, float] = {}
    for raw in got[4:10]:
        for t, (i, o) in _pairs(raw).items():
            minute[t] = minute.get(t, 0.0) + i + dw * o
    total = sum(minute.values())
    for t, v in minute.items():
        acc.row(t, model).share_last_minute = v / total if total else 0.0
    insts = [as_str(x) for x in got[10] + got[11]]
    pipe = c.r.pipeline(transaction=False)
    for inst in insts:
        pipe.hmget(mk.inst(inst), "tenant", "tokens", "items")
    for tenant, tokens, items in pipe.execute():
        if tenant is not None:
            r = acc.row(as_str(tenant), model)
            r.waiting_tokens += int(tokens or 0)
            r.waiting_items += int(items or 0)
    return sorted(_fold_own(c, acc.rows, model, got[1]), key=lambda r: (r.own, r.tenant))


def _fold_own(c: Conductor, rows: dict[str, TenantRow], model: str, weights: dict[Any, Any]) -> list[TenantRow]:
    """The jobs without a tenant (each its own: its name is its tenant, lua/job_class.lua) as one row,
    not a row per job: a tenant whose name is a job's and that has no weight of its own."""
    named = {as_str(t) for t in weights}
    pipe = c.r.pipeline(transaction=False)
    names = [t for t in rows if t not in named]
    for t in names:
        pipe.zscore(K.JOBS_KEY, t)
    own = {t for t, score in zip(names, pipe.execute() if names else [], strict=True) if score is not None}
    out = [r for t, r in rows.items() if t not in own]
    if own:
        folded = TenantRow("", model, own=True)
        for t in own:
            r = rows[t]
            folded.served_in += r.served_in
            folded.served_out += r.served_out
            folded.service += r.service
            folded.share_last_minute += r.share_last_minute
            folded.waiting_tokens += r.waiting_tokens
            folded.waiting_items += r.waiting_items
            folded.virtual = max(folded.virtual, r.virtual)
        out.append(folded)
    return out


def render(rows: list[TenantRow]) -> str:
    if not rows:
        return "no tenants"
    out = [f"{'tenant':<24} {'model':<16} {'weight':>6} {'served (in + w x out)':>22} {'last min':>8} "
           f"{'waiting tokens':>14} {'items':>8}"]
    for r in rows:
        name = "- (no tenant)" if r.own else r.tenant
        out.append(f"{name:<24} {r.model:<16} {r.weight:>6g} {r.service:>22,.0f} {r.share_last_minute:>8.1%} "
                   f"{r.waiting_tokens:>14,} {r.waiting_items:>8,}")
    return "\n".join(out)
