"""Schema 1: the initial layout described in conductor/redis_contract/keys.py.

Nothing to move: an empty Redis already is layout 1. Models are set up lazily (config
defaults with HSETNX, the consumer group with XGROUP CREATE MKSTREAM) by ``ensure_model``.
"""

VERSION = 1


def up(client) -> None:  # noqa: ANN001 - a redis.Redis
    return None
