"""API keys of the Batch API (issue 35): each belongs to a tenant and has a role (``conductor keys``).

A key reads ``ck-<id>-<secret>``: the id (12 hex digits) is public, so that a key is looked up by it
(``cdr:apikey:<id>``) instead of by comparing against every key; the secret (43 url-safe characters,
256 random bits) is never stored: the record holds a salt and PBKDF2-SHA256 of the secret, and a
presented key is checked with ``hmac.compare_digest``. The secret being random, not a password, a
few thousand rounds are enough against a stolen copy of Redis; more would only cost every replica
CPU on each cache miss.

A revoked key keeps its record (``revoked`` set), so ``conductor keys list`` still shows it and the
index ``cdr:apikeys`` never empties: revoking the last key does not turn a replica back into an open
one. ``KeyBook`` is a serve replica's view: it reads Redis again for a key after ``ttl`` seconds (0.5
by default), which is how a revoke reaches every replica within a second without any message.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from conductor.errors import BadInput
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import JobClass

ROLES = ("user", "admin")
DEFAULT_TENANT = "default"  # the tenant of --api-key keys and of an open serve's requests
ROUNDS = 10_000
KEY_RE = re.compile(r"ck-([0-9a-f]{12})-([A-Za-z0-9_-]{43})")
MAX_TOKEN = 512  # longer Authorization values are refused unread
LABEL_MAX = 128
CACHE_MAX = 10_000  # cached answers per replica, past which the cache starts over


@dataclass(frozen=True)
class Identity:
    """Who a request is: the key's id (``open`` on a serve without keys; ``api-key-N`` for the N-th
    ``--api-key``), its tenant and role."""

    key_id: str
    tenant: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def open(self) -> bool:
        return self.key_id == "open"

    def sees(self, tenant: str) -> bool:
        """Whether this identity may see what ``tenant`` owns: an admin sees every tenant's."""
        return self.admin or tenant == self.tenant


OPEN = Identity("open", DEFAULT_TENANT, "admin")


def check_tenant(tenant: str) -> str:
    if not tenant:
        raise BadInput("tenant", "a name is needed")
    JobClass(tenant)  # a tenant's name is checked as a job's class checks it (it bills fair share too)
    return tenant


def _digest(secret: str, salt: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode("ascii"), salt, ROUNDS)


def create(r: redis.Redis, tenant: str, role: str = "user", label: str = "") -> tuple[str, str]:
    """A new key of ``tenant``: (its id, the key itself, shown once and stored nowhere)."""
    check_tenant(tenant)
    if role not in ROLES:
        raise BadInput("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    if len(label) > LABEL_MAX or not label.isprintable():
        raise BadInput("name", f"a label of at most {LABEL_MAX} printable characters")
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    now = int(time.time())
    pipe = r.pipeline(transaction=False)
    # the record first: an index entry never names a key without one
    pipe.hset(K.apikey_key(key_id), mapping={"tenant": tenant, "role": role, "label": label, "salt": salt.hex(),
                                              "hash": _digest(secret, salt).hex(), "created": now})
    pipe.zadd(K.APIKEYS_KEY, {key_id: now})
    pipe.execute()
    return key_id, f"ck-{key_id}-{secret}"


def list_keys(r: redis.Redis) -> list[dict[str, Any]]:
    """Every key, oldest first: id, tenant, role, label, created, last_used, revoked (never a secret
    nor its hash)."""
    ids = [as_str(x) for x in r.zrange(K.APIKEYS_KEY, 0, -1)]
    pipe = r.pipeline(transaction=False)
    for key_id in ids:
        pipe.hmget(K.apikey_key(key_id), "tenant", "role", "label", "created", "last_used", "revoked")
    out = []
    for key_id, got in zip(ids, pipe.execute() if ids else [], strict=True):
        tenant, role, label, created, used, revoked = (as_str(x, absent="") for x in got)
        out.append({"id": key_id, "tenant": tenant, "role": role, "label": label,
                    "created": int(created or 0), "last_used": int(used) if used else None,
                    "revoked": int(revoked) if revoked else None})
    return out


def revoke(r: redis.Redis, key_id: str) -> bool:
    """Revoke a key (its record kept, marked); False when no such key or revoked already."""
    if not re.fullmatch(r"[0-9a-f]{12}", key_id) or not r.exists(K.apikey_key(key_id)):
        return False
    return bool(r.hsetnx(K.apikey_key(key_id), "revoked", int(time.time())))


def any_keys(r: redis.Redis) -> bool:
    return bool(r.exists(K.APIKEYS_KEY))


def lookup(r: redis.Redis, token: str) -> Identity | None:
    """The identity of a presented key, read from Redis now; None for anything else."""
    m = KEY_RE.fullmatch(token)
    if m is None:
        return None
    key_id, secret = m.groups()
    rec = {as_str(k): as_str(v) for k, v in r.hgetall(K.apikey_key(key_id)).items()}
    if not rec or rec.get("revoked") or "hash" not in rec:
        return None
    if not hmac.compare_digest(_digest(secret, bytes.fromhex(rec["salt"])).hex(), rec["hash"]):
        return None
    return Identity(key_id, rec["tenant"], rec["role"])


class KeyBook:
    """A serve replica's keys: those in Redis (answers cached ``ttl`` seconds, so a revoke is in
    force within that) and the ``--api-key`` ones, admin keys of the default tenant."""

    def __init__(self, r: redis.Redis, static: list[str] | None = None, ttl: float = 0.5) -> None:
        self.r, self.ttl = r, ttl
        self.static = {k.encode("utf-8"): Identity(f"api-key-{n}", DEFAULT_TENANT, "admin")
                       for n, k in enumerate((k for k in static or [] if k), 1)}
        self._cache: dict[bytes, tuple[float, Identity | None]] = {}
        self._any: tuple[float, bool] = (0.0, False)
        self._lock = threading.Lock()

    def open(self) -> bool:
        """True while no key is configured anywhere: the replica serves everyone (as before keys)."""
        if self.static:
            return False
        now = time.monotonic()
        at, found = self._any
        if not found and now - at > self.ttl:  # once keys exist they stay (revoked ones too)
            found = any_keys(self.r)
            self._any = (now, found)
        return not found

    def has_stored(self) -> bool:
        return any_keys(self.r)

    def identify(self, token: str) -> Identity | None:
        """The identity of a bearer token, or None (wrong, revoked, malformed: one answer for all)."""
        if not token or len(token) > MAX_TOKEN or not token.isascii():
            return None
        raw = token.encode("ascii")
        for k, flag_key in self.static.items():
            if hmac.compare_digest(raw, k):
                return flag_key
        fp = hashlib.sha256(raw).digest()  # the cache holds no key as sent
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(fp)
        if hit is not None and now - hit[0] <= self.ttl:
            return hit[1]
        ident = lookup(self.r, token)
        if ident is not None:  # its last use, written at most once per ttl per replica and key
            self.r.hset(K.apikey_key(ident.key_id), "last_used", int(time.time()))
        with self._lock:
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[fp] = (now, ident)
        return ident
