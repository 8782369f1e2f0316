"""The packing rule in Python, one copy: padded length, a lane's weight against the token budget,
readiness, and whether an item joins a batch. claim.lua and submit.lua apply the same rule in
Redis (lua/lib.lua); conductor/verify/ checks lanes against it and bench/ plans batches with it."""

from __future__ import annotations


def pad8(n: int) -> int:
    """A length padded up to a multiple of 8 (what a memory-mode batch is padded to)."""
    return -(-n // 8) * 8


def lane_weight(items: int, tokens: int, rep: int, *, disk: bool) -> int:
    """What a lane (or a batch) weighs against the token budget: its tokens in disk mode, its items
    times the padded length of its longest (``rep``) in memory mode."""
    return tokens if disk else items * pad8(rep)


def lane_ready(items: int, tokens: int, rep: int, *, disk: bool, budget_tokens: float, budget_items: float) -> bool:
    """Whether a lane holds a full batch under the model's reference budget."""
    return items >= budget_items or lane_weight(items, tokens, rep, disk=disk) >= budget_tokens


def fits(k: int, maxlen: int, tok: int, size: int, budget: int) -> bool:
    """Whether an item of ``tok`` tokens joins a (memory-mode) batch of ``k`` items whose longest
    has ``maxlen``, under a contract of ``size`` items and ``budget`` tokens; the first item always does."""
    if k == 0:
        return True
    if k >= size:
        return False
    return lane_weight(k + 1, 0, max(maxlen, tok), disk=False) <= budget
