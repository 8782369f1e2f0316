"""Reading Redis for verify: the model's keys found by one SCAN, its config, reads run in one MULTI
(a snapshot of one moment, plain pipelined reads over maxmemory), and bounded pages otherwise."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.client import CaseInsensitiveDict

from conductor.redis_contract import keys as K
from conductor.redis_contract import rules
from conductor.redis_contract.config import DEFAULTS
from conductor.redis_contract.connection import StreamEntry as Entry
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.packing import lane_ready

PAGE = 1000  # entries per SCAN / HSCAN / XRANGE / lane LRANGE step
SNAPSHOT = 10_000  # entries an instance (or the in-flight set) may hold to be read in one MULTI
PENDING_PAGE = 500
LIST_PAGE = 100
EXAMPLES = 20  # item ids quoted per ledger finding


def as_int(v: Any) -> int:
    if v is None:
        return 0
    try:
        return int(float(as_str(v)))
    except ValueError:
        return 0


@dataclass
class Cfg:
    disk: bool
    budget_tokens: float
    budget_items: float

    def ready(self, items: int, tokens: int, rep: int) -> bool:
        return lane_ready(items, tokens, rep, disk=self.disk, budget_tokens=self.budget_tokens,
                          budget_items=self.budget_items)

    @property
    def index_version(self) -> str:
        """lib.lua's index_version: the config an instance's fill and ready indices follow."""
        return f"v2:{self.budget_tokens:.14g}:{self.budget_items:.14g}:{'disk' if self.disk else 'memory'}"


def read_cfg(r: redis.Redis, mk: K.ModelKeys) -> Cfg:
    raw = r.hmget(mk.cfg, ["mode", "budget_tokens", "budget_items"])

    def num(v: Any, name: str) -> float:
        try:
            return float(as_str(v))
        except (TypeError, ValueError):
            return float(DEFAULTS[name])

    return Cfg(disk=as_str(raw[0]) == "disk" if raw[0] else DEFAULTS["mode"] == "disk",
                budget_tokens=num(raw[1], "budget_tokens"), budget_items=num(raw[2], "budget_items"))


@dataclass
class FoundKeys:
    """The model's keys found by one SCAN, grouped by what they hold."""

    insts: set[str] = field(default_factory=set)
    lanes: dict[str, set[str]] = field(default_factory=dict)  # inst -> lane ids (lists or metas)
    jobs: set[str] = field(default_factory=set)
    bats: set[str] = field(default_factory=set)  # tokens of batch item lists M:bat:<token>
    shapes: set[str] = field(default_factory=set)  # signatures with a shape hash M:shape:S


def classify(r: redis.Redis, mk: K.ModelKeys) -> FoundKeys:
    b = re.escape(mk.base)
    sig = f"[0-9a-f]{{{rules.SIG_HEX}}}"
    inst_re = re.compile(rf"^{b}:inst:({sig}:\d+)(?::[a-z_]+)?$")
    lane_re = re.compile(rf"^{b}:lane(?:meta|tok)?:({sig}:\d+):(\d+)$")
    job_re = re.compile(rf"^{b}:(?:job|in):([^:]+)(?::(?:items|results|sums))?$")
    bat_re = re.compile(rf"^{b}:bat:(.+)$")
    shape_re = re.compile(rf"^{b}:shape:({sig})$")
    out = FoundKeys()
    for raw in r.scan_iter(match=f"{mk.base}:*", count=PAGE):
        key = as_str(raw)
        if m := inst_re.match(key):
            out.insts.add(m.group(1))
        elif m := lane_re.match(key):
            out.lanes.setdefault(m.group(1), set()).add(m.group(2))
        elif m := job_re.match(key):
            out.jobs.add(m.group(1))
        elif m := bat_re.match(key):
            out.bats.add(m.group(1))
        elif m := shape_re.match(key):
            out.shapes.add(m.group(1))
    return out


oom = threading.local()  # set when a snapshot fell back to plain reads (Redis over maxmemory)


class Snapshot:
    """Reads queued like a transaction pipeline's and run in one MULTI (a snapshot of one moment).
    Over maxmemory Redis refuses every command queued in MULTI, reads included: the same reads
    then run pipelined without it (not one moment; verify says so in a note), so that a full
    Redis can still be verified while workers drain it."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def queue(*args: Any, **kw: Any) -> Snapshot:
            self.calls.append((name, args, kw))
            return self
        return queue

    def _run(self, transaction: bool, raise_on_error: bool) -> list[Any]:
        pipe = self.r.pipeline(transaction=transaction)
        if transaction and isinstance(self.r, redis.RedisCluster):
            # redis-py's cluster pipeline in MULTI parses replies with the cluster's own callbacks
            # only, leaving XPENDING, XRANGE, SMEMBERS... raw: give it a node's callbacks as well,
            # so that a snapshot reads the same on a cluster as on one Redis
            node_callbacks = self.r.get_default_node().redis_connection.response_callbacks
            pipe.cluster_response_callbacks = CaseInsensitiveDict(
                {**{name: _node_callback(cb) for name, cb in node_callbacks.items()},
                 **self.r.cluster_response_callbacks})
        for name, args, kw in self.calls:
            getattr(pipe, name)(*args, **kw)
        out: list[Any] = pipe.execute(raise_on_error=raise_on_error)
        return out

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        if not getattr(oom, "on", False):
            try:
                return self._run(True, raise_on_error)
            except (redis.exceptions.OutOfMemoryError, redis.exceptions.ExecAbortError):
                oom.on = True
        return self._run(False, raise_on_error)


def _node_callback(cb: Callable[..., Any]) -> Callable[..., Any]:
    """A node client's reply callback called as the cluster transaction calls its own: with the
    command's options, ``keys`` among them, which a node client drops before its callbacks."""
    def parse(reply: Any, **options: Any) -> Any:
        options.pop("keys", None)
        return cb(reply, **options)
    return parse


def pairs(v: Any) -> Any:
    """A hash or stream entry's fields: a dict, or the flat [k, v, k, v, ...] a reply callback
    did not convert (redis-py's cluster pipeline inside MULTI)."""
    return v.items() if isinstance(v, dict) else zip(v[::2], v[1::2], strict=True)


def xrange_pages(r: redis.Redis, key: str, upto: str | None = None) -> Iterator[Entry]:
    start = "-"
    while True:
        page: Any = r.xrange(key, min=start, max=upto or "+", count=PAGE)
        yield from page
        if len(page) < PAGE:
            return
        start = "(" + as_str(page[-1][0])


def list_pages(r: redis.Redis, key: str) -> Iterator[bytes]:
    """A list in bounded LRANGE pages (not one snapshot: see the module docstring)."""
    i = 0
    while True:
        page: Any = r.lrange(key, i, i + PAGE - 1)
        yield from page
        if len(page) < PAGE:
            return
        i += PAGE


def lane_pages(r: redis.Redis, mk: K.ModelKeys, inst: str, lane: str) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """A lane and its token list in bounded pages; each page of both is read in one MULTI, so a
    page's records and tokens are compared at one moment."""
    i = 0
    while True:
        pipe = Snapshot(r)
        pipe.lrange(mk.lane(inst, lane), i, i + PAGE - 1)
        pipe.lrange(mk.lane_tok(inst, lane), i, i + PAGE - 1)
        recs, toks = pipe.execute()
        yield recs, toks
        if len(recs) < PAGE and len(toks) < PAGE:
            return
        i += PAGE


def read_zset(r: redis.Redis, key: str) -> dict[str, float]:
    return {as_str(m): float(s) for m, s in r.zscan_iter(key, count=PAGE)}
