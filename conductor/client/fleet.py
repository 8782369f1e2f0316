"""Which workers are alive, per model: registered in ``M:workers`` with a heartbeat key that has
not expired. Read by the request path (client/request.py), the follow/watch hint
(cli/no_worker_hint.py) and the exporter's workers-alive gauge."""

from __future__ import annotations

import redis

from conductor.redis_contract import keys as K


def live_workers(r: redis.Redis, model: str) -> list[str]:
    mk = K.ModelKeys(model)
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in r.hkeys(mk.workers))
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for n in names:
        pipe.exists(mk.heartbeat(n))
    return [n for n, alive in zip(names, pipe.execute(), strict=True) if alive]
