"""Per-model thresholds, stored as plain fields of ``cdr:{model}:cfg`` (readable in redis-cli).

Every field has a default here; ``ensure_model`` writes missing fields with HSETNX so an
operator's ``conductor config`` change is never overwritten. The Lua scripts read the hash
with HMGET and fall back to the same defaults (``lua/lib.lua`` must agree; tests/test_signature_keys.py checks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conductor.redis_contract import rules

# name -> (default, description); the Lua scripts get them as lib_generated.lua, written from here
# when conductor/redis_contract/scripts.py loads a script (no copy to keep in sync).
FIELDS: dict[str, tuple[Any, str]] = {
    "mode": ("memory", "memory: pad to the longest item rounded up to 8 and count padded tokens; "
                       "disk: count actual tokens and keep the release gate open"),
    "budget_tokens": (8192, "reference batch token budget (the first worker's contract) for readiness"),
    "budget_items": (64, "reference batch size (the first worker's contract) for readiness"),
    "lane_max": (2048, "lanes a shape instance may own"),
    "lane_thr_min": (0.003, "padding fraction that opens a new lane while the lane budget is empty"),
    "lane_thr_max": (0.30, "padding fraction that opens a new lane when the lane budget is full"),
    "lane_floor": (0, "padding (tokens) at or under which an item never opens a new lane; memory mode already "
                     "merges lengths within one 8-token step, raise it for short-prompt workloads"),
    # 12, not 8 (issue 37): at 8 the lanes of shapes holding one to a few batches are wide enough
    # that the packing suite's workload pads 2.11 % (20,000 items) and 0.78 % (100,000) against the
    # goal of 2.08 % and 0.76 %; 12 gives 2.01 % and 0.74 % and leaves the sweep's throughput as it
    # was; 16 pads less still but costs demo-1k a graph build (bench/RESULTS.md, issue 37).
    "lane_depth": (12, "lanes a shape instance may own per full batch (reference budget) it holds waiting: a "
                      "shallow shape gets few wide lanes, a deep one many narrow ones; 0 lifts the limit"),
    "lane_cap": (256, "padding (tokens) above which an item always opens a new lane, budget permitting"),
    "lane_quiet_ms": (3000, "an empty lane without assignments this long returns its id"),
    "activate_batches": (4, "a staged shape activates once it holds this many budgets of tokens"),
    "decode_weight": (64, "fleet scheduling: the work of one output token (max_tokens) in input tokens; a shape's "
                          "remaining work, which decides what a worker takes next, is its waiting input tokens plus "
                          "this times its waiting items' output limits"),
    "drain_batches": (1, "an active shape without a full lane drains below this many budgets"),
    "release_batches": (8, "memory mode: nothing is dispatched before this many budgets are waiting"),
    "quiet_ms": (1000, "intake silent this long (and nothing ready): cleanup mode"),
    "max_waiting_tokens": (0, "queue ceiling in input tokens; 0 is unlimited. Over it submit is refused"),
    "max_deliveries": (5, "an item delivered more often than this goes to the dead letter"),
    "aging_ms": (300000, "a staged shape whose oldest item waited this long preempts the active one; 0 is off"),
    "prewarm_batches": (2, "below this many budgets pending on the active shape, the next shape starts warming"),
    "hygiene_items": (4, "a lane with fewer items than this and no assignment for hygiene_idle_ms is force-drained"),
    "hygiene_idle_ms": (5000, "see hygiene_items"),
    "default_max_tokens": (rules.DEFAULT_MAX_TOKENS, "output cap of an OpenAI batch line that gives neither "
                                                     "max_tokens nor max_completion_tokens (read at the edge: "
                                                     "conductor submit, conductor serve)"),
    "resident_tokens": (0, "disk tier (with a store: --store, CONDUCTOR_STORE): input tokens that wait in Redis at "
                           "most; beyond them submit writes items to store segments, which workers feed back as "
                           "lanes drain. 0: no ceiling, every item waits in Redis"),
    "results_window": (0, "disk tier (with a store): result records kept in Redis per job and model; the lease holder "
                          "moves older ones to store segments, which `conductor results` reads too. 0: all stay"),
    "results_age_s": (0, "disk tier (with a store): result records older than this many seconds move to store "
                         "segments too, whatever results_window says (a follower has read them long ago). 0: off"),
    "shards": (1, "the model's shapes spread over this many shards, each a single-slot copy of its keys on its own "
                  "part of a cluster's slots (conductor/redis_contract/shards.py); 1: the model's own keys. A change "
                  "moves the waiting shapes to their new shards (the workers' lease holder; the old shards drain "
                  "meanwhile)"),
}

DEFAULTS: dict[str, Any] = {k: v[0] for k, v in FIELDS.items()}


def parse_value(name: str, raw: str) -> Any:
    if name not in FIELDS:
        raise ValueError(f"config: unknown field {name!r} (known: {', '.join(FIELDS)})")
    default = DEFAULTS[name]
    if name == "shards":
        from conductor.redis_contract.shards import check_count
        return check_count(raw)
    if name == "mode":
        if raw not in ("memory", "disk"):
            raise ValueError("config: mode must be 'memory' or 'disk'")
        return raw
    try:
        value = type(default)(raw)
    except ValueError:
        raise ValueError(f"config: {name} must be a {type(default).__name__}, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"config: {name} must not be negative")
    return value


def help_table() -> str:
    """Every field with its default and meaning, for ``conductor config --help``."""
    rows = ["thresholds:"]
    for name, (default, text) in FIELDS.items():
        shown = "the first worker's contract" if name in ("budget_tokens", "budget_items") else default
        rows.append(f"  {name} (default: {shown}): {text}")
    return "\n".join(rows)


def markdown_table() -> str:
    """Every field as a row of docs/configuration.md's thresholds table (tests/test_docs.py compares the
    two and prints the table to paste when they part), so the page never lacks a field."""
    rows = ["| name | default | meaning |", "|---|---|---|"]
    for name, (default, text) in FIELDS.items():
        shown = "the first worker's contract" if name in ("budget_tokens", "budget_items") else default
        rows.append(f"| {name} | {shown} | {text} |")
    return "\n".join(rows)


class ModelDefaults:
    """Per-model settings the edge reads while it validates input (one HGET per model, cached):
    ``default_max_tokens`` for an OpenAI line without a cap."""

    def __init__(self, client: Callable[[], Any]) -> None:
        self.client = client  # a function returning the Redis client: connect only when needed
        self._cache: dict[str, int] = {}

    def max_tokens(self, model: str) -> int:
        if model not in self._cache:
            from conductor.redis_contract.keys import ModelKeys
            raw = self.client().hget(ModelKeys(model).cfg, "default_max_tokens")
            try:
                value = int(raw) if raw is not None else DEFAULTS["default_max_tokens"]
            except ValueError:
                value = DEFAULTS["default_max_tokens"]
            self._cache[model] = value if value >= 1 else DEFAULTS["default_max_tokens"]
        return self._cache[model]


# Pairs of fields where the first must not exceed the second: a threshold set past its partner is
# accepted by each field's own check and then quietly means something else (lane_thr_min above
# lane_thr_max opens fewer lanes as the budget fills, the opposite of the rule).
ORDERED: tuple[tuple[str, str], ...] = (("lane_thr_min", "lane_thr_max"), ("lane_floor", "lane_cap"))
AT_LEAST_ONE = ("lane_max", "max_deliveries", "budget_tokens", "budget_items", "default_max_tokens")


def check_relations(current: dict[str, str], new: dict[str, Any]) -> None:
    """Refuses ``new`` values that, with the ``current`` ones (unset: the defaults), break a relation
    between fields; only relations a new value takes part in are judged."""
    def value(name: str) -> Any:
        if name in new:
            return new[name]
        try:
            return parse_value(name, current[name]) if name in current else DEFAULTS[name]
        except ValueError:
            return DEFAULTS[name]
    for lo, hi in ORDERED:
        if (lo in new or hi in new) and value(lo) > value(hi):
            raise ValueError(f"config: {lo} ({value(lo)}) must not exceed {hi} ({value(hi)})")
    for name in AT_LEAST_ONE:
        if name in new and new[name] < 1:
            raise ValueError(f"config: {name} must be at least 1, got {new[name]}")
