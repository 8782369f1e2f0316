"""Which workers are alive, per model: registered in ``M:workers`` with a heartbeat key that has
not expired. Read by the request path (client/request.py), the follow/watch hint
(cli/no_worker_hint.py) and the exporter's workers-alive gauge."""

from __future__ import annotations

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract import shards as S


def live_workers(r: redis.Redis, model: str) -> list[str]:
    """On a shard, a worker lives while its heartbeat on the model's own keys does too
    (``model_alive``)."""
    mk = K.ModelKeys(model)
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in r.hkeys(mk.workers))
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.exists(mk.heartbeat(n))
    live = [n for n, alive in zip(names, pipe.execute(), strict=True) if alive]
    return [n for n, alive in zip(live, model_alive(r, model, live), strict=True) if alive]


def model_alive(r: redis.Redis, name: str, workers: list[str]) -> list[bool]:
    """Whether each worker's heartbeat on the model's own keys lives, for a shard ``name`` (all True
    for any other name). An idle worker of a sharded model beats its shard heartbeats once a round
    of the shards, each living that round, and its model heartbeat every period with the TTL's own
    (workers/idle.py): a worker killed while idle is then dead on every shard a TTL after its last
    beat. A busy worker's heartbeat thread beats them all together, so this changes nothing for it."""
    if not workers or not S.is_shard(name):
        return [True] * len(workers)
    owner = K.ModelKeys(S.fold(name))
    pipe = r.pipeline(transaction=False)
    for n in workers:
        pipe.exists(owner.heartbeat(n))
    return [bool(x) for x in pipe.execute()]
