"""The Batch API's tenants on the command line (issue 35): ``conductor keys`` (create, list, revoke
API keys: conductor/jobs/tenant_keys.py) and ``conductor audit`` (what keys did: conductor/api/audit.py).
``conductor tenant T --max-...`` and ``conductor tenants`` (limits and use) are in cli/admin.py."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from conductor.errors import BadInput, ConductorError

if TYPE_CHECKING:
    import redis


def _redis(args: argparse.Namespace) -> redis.Redis:
    from conductor.cli.connect import url_from
    from conductor.client import connect
    return connect(url_from(args))


def _when(ts: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) if ts else "-"


def cmd_keys(args: argparse.Namespace) -> int:
    from conductor.jobs import tenant_keys
    if args.action == "create":
        if not args.tenant or args.id:
            raise ConductorError("keys create takes --tenant T (and --role, --name), no key id")
        r = _redis(args)
        try:
            key_id, key = tenant_keys.create(r, args.tenant, args.role, args.name or "")
        except BadInput as e:
            raise ConductorError(f"{e.field}: {e}") from None
        finally:
            r.close()
        print(f"key {key_id}: tenant {args.tenant}, role {args.role}{', ' + args.name if args.name else ''}. "
              "The key is shown this once (Redis keeps only its hash):")
        print(key)  # alone on the last line, for a script to take
        return 0
    if args.action == "revoke":
        if not args.id:
            raise ConductorError("keys revoke takes the key's id (conductor keys list shows them)")
        r = _redis(args)
        try:
            if not tenant_keys.revoke(r, args.id):
                raise ConductorError(f"no such key, or revoked already: {args.id}")
        finally:
            r.close()
        print(f"key {args.id} revoked: every serve replica refuses it within a second")
        return 0
    r = _redis(args)
    try:
        rows = tenant_keys.list_keys(r)
    finally:
        r.close()
    if args.tenant:
        rows = [x for x in rows if x["tenant"] == args.tenant]
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no API keys (conductor keys create --tenant T); a serve without keys or --api-key is open")
        return 0
    print(f"{'id':<13} {'tenant':<20} {'role':<6} {'created (UTC)':<20} {'last used (UTC)':<20} {'revoked':<20} label")
    for x in rows:
        print(f"{x['id']:<13} {x['tenant']:<20} {x['role']:<6} {_when(x['created']):<20} {_when(x['last_used']):<20} "
              f"{_when(x['revoked']):<20} {x['label']}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from conductor.api import audit
    r = _redis(args)
    try:
        rows = audit.read(r, args.tenant, args.limit)
    finally:
        r.close()
    print(json.dumps(rows) if args.json else audit.render(rows))
    return 0


def add_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    from conductor.cli.args import positive_int
    k = command("keys", "the Batch API's keys: create one for a tenant (printed once, alone on the last line), "
                        "list them (never a secret), revoke one (refused by every serve replica within a second)",
                cmd_keys)
    k.add_argument("action", choices=["create", "list", "revoke"], help="what to do")
    k.add_argument("id", nargs="?", help="revoke: the key's id (conductor keys list)")
    k.add_argument("--tenant", help="create: the key's tenant (it sees only that tenant's files and batches, and "
                                    "its batches bill that tenant's fair share); list: only this tenant's keys")
    k.add_argument("--role", choices=["user", "admin"], default="user",
                   help="create: user (its tenant's view) or admin (every tenant's, and may act for one)")
    k.add_argument("--name", help="create: a label to tell the key by")
    k.add_argument("--json", action="store_true", help="list: one JSON list")
    a = command("audit", "the Batch API's audit trail: every create, cancel, retry, download and delete, with the "
                         "key, tenant, route and outcome (newest last)", cmd_audit)
    a.add_argument("--tenant", help="only this tenant's records")
    a.add_argument("--limit", type=positive_int, default=100, help="the newest this many records")
    a.add_argument("--json", action="store_true", help="one JSON list")
