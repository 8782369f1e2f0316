"""A tenant's limits on the Batch API (issue 35; ``conductor tenant T --max-...``) and its use of them.

- ``max_enqueued_tokens``: the input tokens of its batches not yet ended, at most; a batch that
  would go past it is refused before anything of it is written (lua/tenant_admit.lua counts a
  batch in ``cdr:tenant:{T}:open`` as it is admitted; an ended one is taken out at the next
  admission, its end read from its job's meta).
- ``max_file_bytes``: the size of one uploaded file, at most (below the API's own 200 MB).
- ``requests_per_minute``: requests of its keys per minute (a counter per minute window,
  ``cdr:tenant:{T}:rate:N``; the window's end is the Retry-After).

The limits live in one hash, ``cdr:tenants:limits`` (tenant -> JSON), so that every tenant with
one is listed by one read; 0 or absent: no limit.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import redis

from conductor.errors import BadInput
from conductor.jobs import job_state
from conductor.jobs.tenant_keys import check_tenant, list_keys
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.scripts import ScriptClient

NAMES = ("max_enqueued_tokens", "max_file_bytes", "requests_per_minute")
MAX_VALUE = 10**15
# a reservation whose batch was never recorded (its replica died between the two writes) lapses after this
ORPHAN_S = 60


@dataclass
class Limits:
    max_enqueued_tokens: int = 0
    max_file_bytes: int = 0
    requests_per_minute: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def limits_of(r: redis.Redis, tenant: str) -> Limits:
    raw = r.hget(K.TENANT_LIMITS_KEY, tenant)
    return _decode(raw)


def _decode(raw: Any) -> Limits:
    if not raw:
        return Limits()
    got = msgspec.json.decode(raw)
    return Limits(**{k: int(got.get(k) or 0) for k in NAMES})


def all_limits(r: redis.Redis) -> dict[str, Limits]:
    return {as_str(t): _decode(v) for t, v in r.hgetall(K.TENANT_LIMITS_KEY).items()}


def set_limits(r: redis.Redis, tenant: str, **values: int | None) -> Limits:
    """Set the limits given (0: none), keep the others; the tenant's limits now."""
    check_tenant(tenant)
    now = limits_of(r, tenant)
    for name, v in values.items():
        if name not in NAMES:
            raise BadInput(name, "not a limit")
        if v is None:
            continue
        if not isinstance(v, int) or not 0 <= v <= MAX_VALUE:
            raise BadInput(name.replace("_", "-"), f"must be a whole number in 0..{MAX_VALUE} (0: no limit)")
        setattr(now, name, v)
    if any(now.as_dict().values()):
        r.hset(K.TENANT_LIMITS_KEY, tenant, msgspec.json.encode(now.as_dict()))
    else:
        r.hdel(K.TENANT_LIMITS_KEY, tenant)
    return now


def _ended(r: redis.Redis, tk: K.TenantKeys) -> tuple[dict[str, int], list[str]]:
    """The tenant's counted batches (batch -> tokens) and those of them that ended (or whose
    reservation was never followed by a batch)."""
    got: list[tuple[bytes, float]] = r.zrange(tk.open, 0, -1, withscores=True)  # type: ignore[assignment]
    rows = [(as_str(b), int(s)) for b, s in got]
    if not rows:
        return {}, []
    pipe = r.pipeline(transaction=False)
    for b, _ in rows:
        pipe.hmget(K.job_meta_key(b), "status", "ending")
        pipe.zscore(tk.opened, b)
    meta = pipe.execute()
    now_ms = int(time.time() * 1000)
    ended = []
    for i, (b, _) in enumerate(rows):
        (status, ending), at = meta[2 * i], meta[2 * i + 1]
        if status is None:
            if at is None or now_ms - int(at) > ORPHAN_S * 1000:
                ended.append(b)
        elif as_str(status) in job_state.TERMINAL or as_str(ending, absent=""):
            ended.append(b)
    return dict(rows), ended


def enqueued(r: redis.Redis, tenant: str) -> int:
    """The input tokens of the tenant's batches not yet ended (reads only)."""
    rows, ended = _ended(r, K.TenantKeys(tenant))
    return sum(v for b, v in rows.items() if b not in ended)


def admit(c: ScriptClient, tenant: str, batch: str, tokens: int, limit: int) -> tuple[bool, int]:
    """Count ``batch`` (``tokens`` input tokens) among the tenant's enqueued ones if it fits ``limit``
    (0: it always does); (admitted, the tenant's enqueued tokens). Ended batches are taken out first."""
    tk = K.TenantKeys(tenant)
    _, ended = _ended(c.r, tk)
    if ended:
        pipe = c.r.pipeline(transaction=False)
        pipe.zrem(tk.open, *ended)
        pipe.zrem(tk.opened, *ended)
        pipe.execute()
    return calls.tenant_admit(tk, batch, tokens, limit, int(time.time() * 1000)).run(c.scripts)


def release(r: redis.Redis, tenant: str, batch: str) -> None:
    """Take a batch out of its tenant's count (a create that failed after its admission)."""
    tk = K.TenantKeys(tenant)
    pipe = r.pipeline(transaction=False)
    pipe.zrem(tk.open, batch)
    pipe.zrem(tk.opened, batch)
    pipe.execute()


def take_request(r: redis.Redis, tenant: str, per_minute: int, now: float | None = None) -> int:
    """Count one request of the tenant in this minute; 0 when within ``per_minute``, else the seconds
    until the next minute (its Retry-After). A refused request counts too: a client that does not
    wait keeps the window full."""
    now = time.time() if now is None else now
    minute = int(now // 60)
    key = K.TenantKeys(tenant).rate(minute)
    pipe = r.pipeline(transaction=False)
    pipe.incr(key)
    pipe.expire(key, 120)
    n = int(pipe.execute()[0])
    return 0 if n <= per_minute else max(1, int((minute + 1) * 60 - now + 0.999))


@dataclass
class Use:
    tenant: str
    limits: Limits = field(default_factory=Limits)
    enqueued_tokens: int = 0
    open_batches: int = 0
    requests_this_minute: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def usage(r: redis.Redis, tenants: list[str] | None = None) -> list[Use]:
    """Use against the limits, per tenant: every tenant with a limit, or ``tenants``."""
    lim = all_limits(r)
    names = tenants if tenants is not None else sorted(set(lim) | {k["tenant"] for k in list_keys(r)})
    minute = int(time.time() // 60)
    out = []
    for t in names:
        rows, ended = _ended(r, K.TenantKeys(t))
        live = {b: v for b, v in rows.items() if b not in ended}
        rate = r.get(K.TenantKeys(t).rate(minute))
        out.append(Use(t, lim.get(t, Limits()), sum(live.values()), len(live), int(rate or 0)))
    return out


def render(rows: list[Use]) -> str:
    if not rows:
        return "no tenant has API limits (conductor tenant T --max-enqueued-tokens N ...)"

    def of(used: int, limit: int) -> str:
        return f"{used:,} / {limit:,}" if limit else f"{used:,} / -"

    out = [f"{'tenant':<24} {'enqueued tokens / limit':>26} {'open batches':>12} {'max file bytes':>15} "
           f"{'requests this min / limit':>26}"]
    for u in rows:
        out.append(f"{u.tenant:<24} {of(u.enqueued_tokens, u.limits.max_enqueued_tokens):>26} "
                   f"{u.open_batches:>12,} {u.limits.max_file_bytes or '-':>15} "
                   f"{of(u.requests_this_minute, u.limits.requests_per_minute):>26}")
    return "\n".join(out)
