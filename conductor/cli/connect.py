"""What every command shares: the Redis URL and the client, from the global flags and the
environment (``--redis``/CONDUCTOR_REDIS_URL, ``--wait-replicas``/CONDUCTOR_WAIT_REPLICAS,
``--store``/CONDUCTOR_STORE)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conductor.client import Conductor

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def url_from(args: argparse.Namespace) -> str:
    return args.redis or os.environ.get("CONDUCTOR_REDIS_URL") or DEFAULT_URL


def conductor_from(args: argparse.Namespace) -> Conductor:
    from conductor.client import Conductor
    from conductor.tier.object_store import store_from
    wait = args.wait_replicas if getattr(args, "wait_replicas", None) is not None else \
        int(os.environ.get("CONDUCTOR_WAIT_REPLICAS", "0") or 0)
    return Conductor.from_url(url_from(args), wait_replicas=wait, store=store_from(getattr(args, "store", None)))
