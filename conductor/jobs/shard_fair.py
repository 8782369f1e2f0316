"""Fair share between tenants over a sharded model's shards (issue 36; lua/lib_fair.lua per shard).

Each shard keeps its own virtual token counters (M:vtc: a tenant's service over its weight), charged
by the claims made there, so a tenant served on one shard would look unserved on the others and be
preferred there too. The lease holder of the model (workers/shard_maintenance.py) tops the counters
up: each shard's counter of a tenant grows by what the tenant's counters grew on the other shards
since the last sync, so every shard judges a tenant by its service over the whole model. Counters
only grow (lib_fair.lua's invariant): a top-up is an HINCRBYFLOAT of a growth, never a decrease.

The growth a sync saw is kept in the process (``last``): a new lease holder starts from the counters
as it finds them, and only growth after that is spread (nothing is counted twice)."""

from __future__ import annotations

from typing import Any

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str


class ShardFair:
    def __init__(self, r: Any) -> None:
        self.r = r
        self.last: dict[str, dict[str, float]] = {}  # shard -> tenant -> its counter after the last sync

    def sync(self, shards: list[str]) -> dict[str, float]:
        """One top-up over ``shards``; returns the growth spread per tenant."""
        if len(shards) < 2:
            return {}
        now = {s: {as_str(t): float(as_str(v)) for t, v in self.r.hgetall(K.ModelKeys(s).vtc).items()}
               for s in shards}
        first = {s for s in shards if s not in self.last}
        grown: dict[str, dict[str, float]] = {}
        for s in shards:
            if s in first:
                continue
            for t, v in now[s].items():
                g = v - self.last[s].get(t, 0.0)
                if g > 0:
                    grown.setdefault(s, {})[t] = g
        spread: dict[str, float] = {}
        for s in shards:
            add: dict[str, float] = {}
            for o, by_tenant in grown.items():
                if o == s:
                    continue
                for t, g in by_tenant.items():
                    add[t] = add.get(t, 0.0) + g
            if not add:
                continue
            pipe = self.r.pipeline(transaction=False)
            for t, g in add.items():
                pipe.hincrbyfloat(K.ModelKeys(s).vtc, t, g)
                now[s][t] = now[s].get(t, 0.0) + g
                spread[t] = spread.get(t, 0.0) + g
            pipe.execute()
        self.last = now
        return spread
