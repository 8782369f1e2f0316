"""A worker's claims over its model's shards (issue 36; conductor/redis_contract/shards.py).

The worker stays on one shard while it gives batches; every REORDER_S it orders the shards again
by waiting tokens per worker serving them (M:intake ``tokens`` over 1 + the workers whose affinity
is there), most first, so the fleet's balance spans the shards. A claim that finds nothing on one
shard tries the next at once: an idle answer means every shard had nothing. A shard whose slot is
half moved (a reshard: TRYAGAIN or ASK, the claim did not run) is skipped and tried after every other
for SKIP_REFUSED_S; while it holds the only work the answer is 'wait' (claim again soon), and only a
refusal from every shard raises.

An unsharded model (the default) claims exactly as before: one claim.lua call on the model."""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec
import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import Batch, Contract

from .shard_route import WORKER_LAYOUT_TTL_S

REORDER_S = 2.0
# A shard whose claim was refused before it ran (its slot half moved: a reshard, tests/test_shards_chaos.py)
# goes after every other shard this long: the claim raised, and the worker rode the refusal out and tried
# that shard first again, while the other shards' work waited for the move to end.
SKIP_REFUSED_S = 5.0
# What claim.lua's call raises when its slot is half moved and it did not run (conductor/client/claiming.py
# retries it three times in about 0.3 s first): TRYAGAIN where its keys are split, ASK where all moved.
REFUSED_MID_MOVE = (redis.exceptions.TryAgainError, redis.exceptions.AskError)
# What an empty round over the shards answers, the first found in this order: work held back
# somewhere (quiet intake, the release gate) keeps the worker's timed wait short.
_REASONS = ("wait", "gate", "nogroup", "paused")


class ShardClient(Protocol):
    r: Any

    def shards(self, model: str, max_age_s: float = ...) -> list[str]: ...

    def layout(self, model: str, *, fresh: bool = False, max_age_s: float = ...) -> Any: ...

    def claim(self, contract: Contract, consumer: str) -> tuple[Batch | None, str]: ...


class ShardClaims:
    def __init__(self, c: ShardClient, model: str) -> None:
        self.c = c
        self.model = model
        self._order: list[str] = []
        self._next = 0.0
        self._refused: dict[str, float] = {}  # shard -> until when it goes last (it refused a claim)

    def names(self) -> list[str]:
        """The model's shards that may hold work (the model alone when unsharded)."""
        return self.c.shards(self.model, max_age_s=WORKER_LAYOUT_TTL_S)

    @property
    def sharded(self) -> bool:
        return self.names() != [self.model]

    def bell_model(self) -> str:
        """Whose doorbell an idle worker waits on: the model's own, whatever its count (a submit to
        any shard rings it too: conductor/client/shard_route.py), so that a worker started before a
        change of the count still wakes for work on the new shards."""
        return self.model

    def claim(self, contract: Contract, consumer: str) -> tuple[Batch | None, str]:
        names = self.names()
        if names == [contract.model]:
            return self.c.claim(contract, consumer)
        if self.model not in names:
            # items on the model's own keys while it is sharded: only a request client of a landing before
            # requests followed the shards (conductor/client/request.py) still sends them there
            names = [*names, self.model]
        reasons = []
        now = time.monotonic()
        ordered = self._ordered(names)
        # a shard that refused lately (its slot half moved) last, after every other
        ordered = sorted(ordered, key=lambda n: self._refused.get(n, 0.0) > now)
        refused: BaseException | None = None
        for name in ordered:
            try:
                batch, why = self.c.claim(msgspec.structs.replace(contract, model=name), consumer)
            except REFUSED_MID_MOVE as e:
                # its slot half moved (a reshard): the claim did not run there; the other shards first
                refused = e
                self._refused[name] = time.monotonic() + SKIP_REFUSED_S
                continue
            self._refused.pop(name, None)
            if batch is not None:
                if self._order and self._order[0] != name:  # stay where the work was found
                    self._order.remove(name)
                    self._order.insert(0, name)
                return batch, why
            reasons.append(why)
        if refused is not None:
            if not reasons:
                raise refused  # every shard refused: the worker rides it out as any failed claim
            return None, "wait"  # work may wait on the refusing shard: claim again soon, not at a beat
        return None, next((r for r in _REASONS if r in reasons), reasons[-1] if reasons else "idle")

    def _ordered(self, names: list[str]) -> list[str]:
        now = time.monotonic()
        if now < self._next and set(self._order) == set(names):
            return self._order
        self._next = now + REORDER_S
        pipe = self.c.r.pipeline(transaction=False)
        for name in names:
            mk = K.ModelKeys(name)
            pipe.hget(mk.intake, "tokens")
            pipe.hlen(mk.affinity)
            pipe.llen(mk.reclaimed)
        got = pipe.execute()
        score = {}
        for i, name in enumerate(names):
            tokens, serving, back = got[3 * i], got[3 * i + 1], got[3 * i + 2]
            # a shard with batches taken back first: they are served before any lane
            score[name] = (int(back or 0) > 0, int(as_str(tokens) or 0) / (1 + int(serving or 0)) if tokens else 0.0)
        self._order = sorted(names, key=lambda n: score[n], reverse=True)
        return self._order
