"""What every part of the client shares: the connection, the scripts, model setup and admin, and
a script call confirmed on replicas (WAIT). The parts (submit, claim, writeback, job reads) are
mixins over this core; conductor/client/__init__.py puts them together as ``Conductor``."""

from __future__ import annotations

from typing import Any, TypeVar

import redis

from conductor.errors import BadInput, NotReplicated
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.config import DEFAULTS
from conductor.redis_contract.connection import as_str, connect, pool_for
from conductor.redis_contract.schema import check as check_schema
from conductor.redis_contract.scripts import Scripts
from conductor.tier.object_store import Store
from conductor.tier.spill import Tier

R = TypeVar("R")


class ConductorCore:
    """One client of one Redis; cheap to create, safe to use from one thread at a time."""

    def __init__(self, client: redis.Redis, *, migrate: bool = True, wait_replicas: int = 0,
                 wait_timeout_ms: int = 1000, store: Store | None = None) -> None:
        """``wait_replicas``: submit and complete return only once that many replicas hold
        their writes (WAIT), else raise NotReplicated: with asynchronous replication a failover
        may otherwise lose writes the old primary acknowledged. ``store``: the disk tier's
        (conductor/tier/), used for models with a resident_tokens ceiling."""
        self.r = client
        self.tier = Tier(client, store) if store is not None else None
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.scripts = Scripts(client)
        check_schema(client, auto=migrate)
        self._models_ready: set[str] = set()
        self._models_listed: set[str] = set()  # models a producer put in the models set (no cfg write)
        self._store_probed = False  # the disk tier's store checked writable (submit_stream.py)
        self._prefix_cache: dict[tuple[str, str], list[str]] = {}
        # the claim's own connection, per server (one, or one per cluster node that holds a model)
        # keyed by the pool itself, not id(): a pool dropped after a slot-map refresh stays
        # referenced here, so its id is never reused for another node's pool
        self._hot_conns: dict[redis.ConnectionPool, Any] = {}
        # (model, consumer) -> tokens of claims whose reply was lost (conductor/client/claiming.py)
        self._lost_claims: dict[tuple[str, str], list[str]] = {}

    @classmethod
    def from_url(cls: type[C], url: str, **kw: Any) -> C:
        return cls(connect(url), **kw)

    # ------------------------------------------------------------------ models
    def ensure_model(self, model: str, force: bool = False) -> K.ModelKeys:
        mk = K.ModelKeys(model)
        if model in self._models_ready and not force:
            return mk
        # The reference budget is the first worker's contract (seed 001), set when it registers; an
        # unset shard count is 1 (conductor/client/shard_route.py), left unwritten: today's cfg.
        defaults = [(name, value) for name, value in DEFAULTS.items()
                    if name not in ("budget_tokens", "budget_items", "shards")]
        # One allow-oom script (lua/ensure_model.lua), not HSETNX and XGROUP CREATE: over maxmemory
        # Redis refuses those (even when they would change nothing), and a fresh worker must still
        # register to drain a full Redis. The models set is in another slot: read first, so that a
        # known model writes nothing there.
        calls.ensure_model(mk, defaults).run(self.scripts)
        if not self.r.sismember(K.MODELS_KEY, model):
            self.r.sadd(K.MODELS_KEY, model)
            # tenant weights set before this model existed (conductor/jobs/tenants.py); its own win
            for tenant, weight in self.r.hgetall(K.TENANTS_KEY).items():
                self.r.hsetnx(mk.tenants, tenant, weight)
        self._models_ready.add(model)
        return mk

    def pause(self, model: str) -> None:
        """Every script that writes this model's keys refuses until resume (workers ride it out,
        producers get Paused): its keys may then move between cluster nodes, or be migrated,
        with nothing half-written. Batches in flight stay in flight."""
        self.r.hset(self.ensure_model(model).state, "paused", 1)

    def resume(self, model: str) -> None:
        self.r.hdel(self.ensure_model(model).state, "paused")

    def set_config(self, model: str, values: dict[str, Any]) -> None:
        mk = self.ensure_model(model)
        if values:
            self.r.hset(mk.cfg, mapping=values)  # type: ignore[arg-type]  # config values: str, int, float
            if {"budget_tokens", "budget_items", "mode"} & set(values):
                self.reindex(model)

    def reindex(self, model: str) -> int:
        """Re-derive lane indices of every waiting shape instance after the reference contract or
        mode changed; returns how many instances were re-derived (claim also does it lazily)."""
        mk = K.ModelKeys(model)
        insts = ({as_str(i) for i in self.r.zrange(mk.staged, 0, -1)}
                 | {as_str(i) for i in self.r.zrange(mk.active, 0, -1)})
        return sum(calls.reindex(mk, i).run(self.scripts) for i in insts if i)

    def config(self, model: str) -> dict[str, str]:
        mk = K.ModelKeys(model)
        return {as_str(k): as_str(v) for k, v in self.r.hgetall(mk.cfg).items()}

    def models(self) -> list[str]:
        return sorted(as_str(m) for m in self.r.smembers(K.MODELS_KEY))

    def job_models(self, job: str) -> list[str]:
        return sorted(as_str(m) for m in self.r.smembers(K.job_models_key(job)))

    # ------------------------------------------------------------------ confirmed writes
    def _confirmed(self, call: calls.Call[R]) -> R:
        """The script's reply; with wait_replicas, once its writes reached that many replicas
        (WAIT runs on the connection that wrote them: a pipeline keeps the two together)."""
        if not self.wait_replicas:
            return call.run(self.scripts)
        pipe = self.r.pipeline(transaction=False)
        call.queue(self.scripts, pipe)
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
        try:
            reply, acked = pipe.execute()
        except redis.ResponseError as e:
            calls.raise_script_error(e)
        self._replicated(acked)
        return call.reply(reply)

    def _replicated(self, acked: Any) -> None:
        if int(acked) < self.wait_replicas:
            raise NotReplicated(f"{acked} of {self.wait_replicas} replicas confirmed the write within "
                                f"{self.wait_timeout_ms} ms; it is on the primary, and sending it again is safe")

    def _pool_for(self, key: str) -> redis.ConnectionPool:
        return pool_for(self.r, key)


C = TypeVar("C", bound=ConductorCore)


def check_name(kind: str, value: str) -> None:
    """A job or model name as keys.py allows it, else BadInput naming the field."""
    try:
        K.check_name(kind, value)
    except ValueError as e:
        raise BadInput(kind, str(e).split(": ", 1)[1]) from None
