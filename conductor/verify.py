"""Recompute every counter the conductor keeps from the data it counts, and repair drift.

The conductor decides everything from counters (waiting tokens per model, shape instance and
lane; lane fill and readiness; in-flight and reclaimed items; job counts). ``verify`` reads the
data those counters summarise and returns one row per counter: recorded value, truth, difference.

What is checked, for one model (``M`` = ``cdr:{model}``):

- every lane, a list of item records ``M:lane:S:E:L`` with its parallel token list
  ``M:lanetok:S:E:L``: the token list as long as the lane and each of its tokens equal to the
  input_tokens of the record at the same position (claim.lua packs from the token list without
  reading the records, so a wrong token there mis-packs a batch); the lane's length and the sum
  of its token list against ``M:lanemeta:S:E:L`` items and tokens; the lane's rep bounds its
  longest item; ``M:inst:S:E:lanes`` scores the rep; ``fill`` scores the rep too, for a
  non-empty lane only (absent for an empty one);
  ``ready`` holds exactly the lanes with a full batch;
- every shape instance ``M:inst:S:E``: tokens and items against the sum of its lanes' truth;
  a staged or warming instance is in ``M:staged`` scored with its tokens, no other one is; an
  instance whose indices follow an older config (``idx``, lib.lua) awaits re-derivation by the
  next claim: its fill scores and readiness are noted, not checked;
- the model (``M:intake``, the producer's counters, and ``M:state``, the fleet's): tokens and
  items against the sum of its instances' counters;
  inflight_batches and inflight_items against the group's pending entries (XPENDING) and the
  ``n`` field of each; reclaimed_items against the item records inside the reclaimed list's
  entries, and each entry's token list as long as its records;
  submitted, completed and failed against the sum of its jobs' counters; batch entries that
  are not pending (leaked: nothing would ever retire them);
- every job: ``M:in:J`` submitted against the ids of its registry ``M:in:J:sums``;
  ``M:job:J`` completed and failed against the ok and error records of ``M:job:J:results``
  (after retention trimmed them, their sum against the done items); done marks ('d' in
  ``M:job:J:items``) against the number of records.

Each level is checked against the level below, so one wrong counter shows up next to both of
its neighbours (an instance's tokens against its lanes, and the model's tokens against it).

With ``items=True`` it also keeps a ledger of every item id: each queued ('q') item must be in
exactly one place (a lane, a pending batch's list ``M:bat:<k>``, or a reclaimed batch), no done
item may wait in a lane, and nothing waits that no job submitted. That costs memory in proportion
to the items. An item record that does not decode is a finding with or without the ledger.

Reads are bounded: an instance with at most SNAPSHOT entries (with its lanes, metas and
indices), the in-flight and reclaimed sets, each small job, and each level's totals are read in
one MULTI, so those rows compare values of one moment even while scripts run (a MULTI of 10,000
entries is a few ms of server time; with the ledger, the pending batches' item lists join the
in-flight MULTI once their names are known). Bigger ones are read in pages (SCAN, HSCAN, XRANGE,
XPENDING with COUNT, LRANGE of bounded ranges) and are not one snapshot: against a live system such a row, or a
row whose key appeared between two reads (a new shape instance, a changed config), can differ
only because a script ran in between. Run against a quiet system, or re-check:
``verify_confirmed`` reports only rows that differ the same way in two passes (timings and
transient rows seen on a live run: bench/RESULTS.md, "Figures moved from code comments").

``repair`` rewrites counters from the truth: each shape instance (its lanes, metas, indices,
counters and staged score) in one Lua call (lua/repair.lua), then the model's counters (as the
sum of the repaired instances and of the jobs) and the job counters in a WATCH/MULTI transaction
that gives up when a script writes the model's state in between (retried a few times). Before
the counters, ``repair_items`` puts items of orphaned places back (lua/repair_items.lua): a batch
list no pending batch names, a lane of a gone instance (to the reclaimed list, or cleared when
they have a result), and items with a result in a live lane. Items counted queued that are in no
place, duplicated items and items no job knows stay ledger findings, for a human.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from conductor import keys as K
from conductor.config import DEFAULTS

log = logging.getLogger("conductor.verify")

PAGE = 1000  # entries per SCAN / HSCAN / XRANGE / lane LRANGE step
SNAPSHOT = 10_000  # entries an instance (or the in-flight set) may hold to be read in one MULTI
# The model counters a producer writes (M:intake, keys.py); every other one is in M:state.
INTAKE_FIELDS = frozenset({"tokens", "items", "submitted"})
PENDING_PAGE = 500
LIST_PAGE = 100
EXAMPLES = 20  # item ids quoted per ledger finding

_blob_decoder = msgspec.msgpack.Decoder()


class _Rec(msgspec.Struct, array_like=True):
    """The head of an item record ``[id, job, input_tokens, max_tokens, prompt, payload]``: all
    that verify needs (msgspec skips the trailing elements)."""

    id: str
    job: str
    input_tokens: int


_rec_decoder = msgspec.json.Decoder(_Rec)


def _rec(raw: Any) -> _Rec | None:
    """One item record, or None when it does not decode (reported, never guessed at)."""
    try:
        return _rec_decoder.decode(raw)
    except (msgspec.DecodeError, TypeError):
        return None


class _ResultStatus(msgspec.Struct):
    id: str
    error: Any = None


_result_decoder = msgspec.json.Decoder(_ResultStatus)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _i(v: Any) -> int:
    if v is None:
        return 0
    try:
        return int(float(_s(v)))
    except ValueError:
        return 0


def pad8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True)
class Row:
    """One counter next to the truth it counts. ``kind`` groups rows for the drift gauge."""

    model: str
    key: str
    field: str
    recorded: int
    truth: int
    kind: str

    @property
    def diff(self) -> int:
        return self.recorded - self.truth


@dataclass
class Report:
    model: str
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # ledger findings (items=True), unreadable records
    notes: list[str] = field(default_factory=list)  # what was not checked, and why
    # items=True: queued items by place (waiting, inflight, reclaimed) and done items, so that
    # submitted == waiting + inflight + reclaimed + done can be checked item by item.
    ledger: dict[str, int] = field(default_factory=dict)
    # items=True: lanes ("S:E:L") holding items that already have a result (repair clears them)
    done_lanes: set[str] = field(default_factory=set)

    @property
    def drift(self) -> list[Row]:
        return [r for r in self.rows if r.diff]

    @property
    def ok(self) -> bool:
        return not self.drift and not self.problems

    def by_kind(self) -> dict[str, int]:
        """Sum of absolute differences per kind of counter (the drift gauge's value)."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.kind] = out.get(r.kind, 0) + abs(r.diff)
        return out


@dataclass
class _Lane:
    """One lane's truth: items from its record list, tokens and the longest from its token list
    (what claim.lua packs from and lua/repair.lua recounts)."""

    items: int = 0
    tok_len: int = 0
    tokens: int = 0
    max_tok: int = 0
    # positions whose token differs from the record's input_tokens: (index, token, record's)
    bad: list[tuple[int, int, int]] = field(default_factory=list)
    n_bad: int = 0
    unreadable: int = 0


@dataclass
class _Cfg:
    disk: bool
    budget_tokens: float
    budget_items: float

    def weight(self, items: int, tokens: int, rep: int) -> int:
        return tokens if self.disk else items * pad8(rep)

    def ready(self, items: int, tokens: int, rep: int) -> bool:
        return items >= self.budget_items or self.weight(items, tokens, rep) >= self.budget_tokens

    @property
    def index_version(self) -> str:
        """lib.lua's index_version: the config an instance's fill and ready indices follow."""
        return f"v2:{self.budget_tokens:.14g}:{self.budget_items:.14g}:{'disk' if self.disk else 'memory'}"


def _cfg(r: redis.Redis, mk: K.ModelKeys) -> _Cfg:
    raw = r.hmget(mk.cfg, ["mode", "budget_tokens", "budget_items"])

    def num(v: Any, name: str) -> float:
        try:
            return float(_s(v))
        except (TypeError, ValueError):
            return float(DEFAULTS[name])

    return _Cfg(disk=_s(raw[0]) == "disk" if raw[0] else DEFAULTS["mode"] == "disk",
                budget_tokens=num(raw[1], "budget_tokens"), budget_items=num(raw[2], "budget_items"))


@dataclass
class _Keys:
    """The model's keys found by one SCAN, grouped by what they hold."""

    insts: set[str] = field(default_factory=set)
    lanes: dict[str, set[str]] = field(default_factory=dict)  # inst -> lane ids (lists or metas)
    jobs: set[str] = field(default_factory=set)
    bats: set[str] = field(default_factory=set)  # tokens of batch item lists M:bat:<token>
    shapes: set[str] = field(default_factory=set)  # signatures with a shape hash M:shape:S


def _classify(r: redis.Redis, mk: K.ModelKeys) -> _Keys:
    b = re.escape(mk.base)
    inst_re = re.compile(rf"^{b}:inst:([0-9a-f]{{16}}:\d+)(?::[a-z_]+)?$")
    lane_re = re.compile(rf"^{b}:lane(?:meta|tok)?:([0-9a-f]{{16}}:\d+):(\d+)$")
    job_re = re.compile(rf"^{b}:(?:job|in):([^:]+)(?::(?:items|results|sums))?$")
    bat_re = re.compile(rf"^{b}:bat:(.+)$")
    shape_re = re.compile(rf"^{b}:shape:([0-9a-f]{{16}})$")
    out = _Keys()
    for raw in r.scan_iter(match=f"{mk.base}:*", count=PAGE):
        key = _s(raw)
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


_oom = threading.local()  # set when a snapshot fell back to plain reads (Redis over maxmemory)


class _Snapshot:
    """Reads queued like a transaction pipeline's and run in one MULTI (a snapshot of one moment).
    Over maxmemory Redis refuses every command queued in MULTI, reads included: the same reads
    then run pipelined without it (not one moment; verify says so in a note), so that a full
    Redis can still be verified while workers drain it."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        def queue(*args: Any, **kw: Any) -> _Snapshot:
            self.calls.append((name, args, kw))
            return self
        return queue

    def _run(self, transaction: bool, raise_on_error: bool) -> list:
        pipe = self.r.pipeline(transaction=transaction)
        for name, args, kw in self.calls:
            getattr(pipe, name)(*args, **kw)
        return pipe.execute(raise_on_error=raise_on_error)

    def execute(self, raise_on_error: bool = True) -> list:
        if not getattr(_oom, "on", False):
            try:
                return self._run(True, raise_on_error)
            except (redis.exceptions.OutOfMemoryError, redis.exceptions.ExecAbortError):
                _oom.on = True
        return self._run(False, raise_on_error)


def _pairs(v: Any) -> Any:
    """A hash or stream entry's fields: a dict, or the flat [k, v, k, v, ...] a reply callback
    did not convert (redis-py's cluster pipeline inside MULTI)."""
    return v.items() if isinstance(v, dict) else zip(v[::2], v[1::2], strict=True)


def _xrange(r: redis.Redis, key: str, upto: str | None = None) -> Iterator[tuple[bytes, dict]]:
    start = "-"
    while True:
        page = r.xrange(key, min=start, max=upto or "+", count=PAGE)
        yield from page
        if len(page) < PAGE:
            return
        start = "(" + _s(page[-1][0])


def _list(r: redis.Redis, key: str) -> Iterator[bytes]:
    """A list in bounded LRANGE pages (not one snapshot: see the module docstring)."""
    i = 0
    while True:
        page = r.lrange(key, i, i + PAGE - 1)
        yield from page
        if len(page) < PAGE:
            return
        i += PAGE


def _lane_pages(r: redis.Redis, mk: K.ModelKeys, inst: str, lane: str) -> Iterator[tuple[list, list]]:
    """A lane and its token list in bounded pages; each page of both is read in one MULTI, so a
    page's records and tokens are compared at one moment."""
    i = 0
    while True:
        pipe = _Snapshot(r)
        pipe.lrange(mk.lane(inst, lane), i, i + PAGE - 1)
        pipe.lrange(mk.lane_tok(inst, lane), i, i + PAGE - 1)
        recs, toks = pipe.execute()
        yield recs, toks
        if len(recs) < PAGE and len(toks) < PAGE:
            return
        i += PAGE


def _zset(r: redis.Redis, key: str) -> dict[str, float]:
    return {_s(m): float(s) for m, s in r.zscan_iter(key, count=PAGE)}


class _Ledger:
    """Where every item id is: (job, id) -> places. Only kept with items=True."""

    def __init__(self) -> None:
        self.places: dict[tuple[str, str], list[str]] = {}
        self.state: dict[tuple[str, str], str] = {}

    def add(self, job: Any, iid: Any, place: str) -> None:
        self.places.setdefault((_s(job), _s(iid)), []).append(place)

    def counts(self) -> dict[str, int]:
        out = {"submitted": len(self.state), "done": 0, "waiting": 0, "inflight": 0, "reclaimed": 0, "orphaned": 0,
               "stored": 0}
        kinds = {"lane": "waiting", "batch": "inflight", "orphan": "orphaned", "store": "stored"}
        for key, st in self.state.items():
            if st != "q":
                out["done"] += 1
                continue
            for p in self.places.get(key, []):
                out[kinds.get(p.split(" ", 1)[0], "reclaimed")] += 1
        return out

    def done_lanes(self) -> set[str]:
        """Lanes ("S:E:L") holding items that have a result (lua/repair_items.lua 'done' clears them)."""
        return {p.split(" ", 1)[1] for key, st in self.state.items() if st != "q"
                for p in self.places.get(key, []) if p.startswith("lane ")}

    def problems(self, model: str) -> list[str]:
        lost, dup, phantom, done_waiting, orphaned = [], [], [], [], []
        for key, st in self.state.items():
            places = self.places.get(key, [])
            if st == "q":
                if not places:
                    lost.append(key)
                elif len(places) > 1:
                    dup.append((key, places))
                elif places[0].startswith("orphan "):
                    orphaned.append((key, places[0].split(" ", 1)[1]))
            elif any(p.startswith(("lane ", "orphan ")) for p in places):
                done_waiting.append((key, places))
        for key, places in self.places.items():
            if key not in self.state:
                phantom.append((key, places))
        out = []

        def show(xs: list) -> str:
            return ", ".join(str(x) for x in xs[:EXAMPLES]) + (" ..." if len(xs) > EXAMPLES else "")

        if lost:
            out.append(f"{model}: {len(lost)} queued item(s) are in no lane, pending batch or reclaimed batch "
                       f"(lost): {show(lost)}")
        if orphaned:
            out.append(f"{model}: {len(orphaned)} queued item(s) wait in a batch list that no pending batch names "
                       f"(orphaned; --repair puts them back): {show(orphaned)}")
        if dup:
            out.append(f"{model}: {len(dup)} queued item(s) are in more than one place (duplicated): {show(dup)}")
        if done_waiting:
            out.append(f"{model}: {len(done_waiting)} item(s) with a result still wait in a lane or an orphaned "
                       f"batch list (--repair clears them): {show(done_waiting)}")
        if phantom:
            out.append(f"{model}: {len(phantom)} item(s) wait that no job submitted: {show(phantom)}")
        return out


@dataclass
class _InstRead:
    """What one shape instance holds; ``atomic`` when it was read in one MULTI (a snapshot)."""

    ih: dict[str, str]
    lanes_z: dict[str, float]
    fill: dict[str, float]
    ready: dict[str, float]
    free: set[str]
    staged_score: float | None
    lanes: dict[str, tuple[_Lane, list[Any]]]  # lane id -> (truth, meta items/tokens/rep)
    atomic: bool


def _lane_truth(pages: Any, inst: str, lane: str, ledger: _Ledger | None) -> _Lane:
    """``pages``: (records, tokens) pairs of the lane and its token list, in order."""
    t = _Lane()
    for recs, toks in pages:
        base = t.items
        for raw in toks:
            tok = _i(raw)
            t.tok_len += 1
            t.tokens += tok
            t.max_tok = max(t.max_tok, tok)
        for j, raw in enumerate(recs):
            t.items += 1
            rec = _rec(raw)
            if rec is None:
                t.unreadable += 1
                continue
            if j < len(toks) and _i(toks[j]) != rec.input_tokens:
                t.n_bad += 1
                if len(t.bad) < EXAMPLES:
                    t.bad.append((base + j, _i(toks[j]), rec.input_tokens))
            if ledger is not None:
                ledger.add(rec.job, rec.id, f"lane {inst}:{lane}")
    return t


def _read_instance(r: redis.Redis, mk: K.ModelKeys, inst: str, scanned: set[str],
                   ledger: _Ledger | None) -> _InstRead:
    """One MULTI per instance when it holds at most SNAPSHOT entries (each row then compares values
    of one moment, even on a live system); bounded pages otherwise."""
    ik = mk.inst(inst)
    # A lane opened between the two reads sends it round again; under steady intake that can take
    # a few rounds, and falling back to pages would report a moment's drift.
    for _attempt in range(20):
        pipe = r.pipeline(transaction=False)
        for z in (mk.inst_lanes(inst), mk.inst_fill(inst), mk.inst_ready(inst)):
            pipe.zrange(z, 0, -1)
        ids = sorted({_s(x) for got in pipe.execute() for x in got} | scanned, key=int)
        pipe = r.pipeline(transaction=False)
        for lane in ids:
            pipe.llen(mk.lane(inst, lane))
            pipe.llen(mk.lane_tok(inst, lane))
        if sum(pipe.execute()) > 2 * SNAPSHOT:
            break
        pipe = _Snapshot(r)
        pipe.hgetall(ik)
        for z in (mk.inst_lanes(inst), mk.inst_fill(inst), mk.inst_ready(inst)):
            pipe.zrange(z, 0, -1, withscores=True)
        pipe.smembers(mk.inst_free(inst))
        pipe.zscore(mk.staged, inst)
        for lane in ids:
            # Bounded even if the lanes grew since LLEN: a lane cut at SNAPSHOT + 1 entries
            # pushes the sum over the limit below, and the instance is read again.
            pipe.lrange(mk.lane(inst, lane), 0, SNAPSHOT)
            pipe.lrange(mk.lane_tok(inst, lane), 0, SNAPSHOT)
            pipe.hmget(mk.lanemeta(inst, lane), ["items", "tokens", "rep"])
        res = pipe.execute()
        lanes_z, fill, ready = ({_s(m): float(sc) for m, sc in z} for z in res[1:4])
        if not (set(lanes_z) | set(fill) | set(ready)) <= set(ids):
            continue  # a lane opened between the two reads: read again
        if sum(len(res[6 + 3 * i]) + len(res[7 + 3 * i]) for i in range(len(ids))) > 2 * SNAPSHOT:
            continue  # grew past the snapshot size meanwhile (and may be cut): read again
        lanes = {}
        for i, lane in enumerate(ids):
            recs, toks, meta = res[6 + 3 * i], res[7 + 3 * i], res[8 + 3 * i]
            lanes[lane] = (_lane_truth([(recs, toks)], inst, lane, ledger), meta)
        return _InstRead({_s(k): _s(v) for k, v in res[0].items()}, lanes_z, fill, ready,
                         {_s(x) for x in res[4]}, None if res[5] is None else float(res[5]), lanes, True)
    ih = {_s(k): _s(v) for k, v in r.hgetall(ik).items()}
    lanes_z = _zset(r, mk.inst_lanes(inst))
    fill = _zset(r, mk.inst_fill(inst))
    ready = _zset(r, mk.inst_ready(inst))
    free = {_s(x) for x in r.sscan_iter(mk.inst_free(inst), count=PAGE)}
    lanes = {}
    for lane in sorted(set(lanes_z) | set(fill) | set(ready) | scanned, key=int):
        t = _lane_truth(_lane_pages(r, mk, inst, lane), inst, lane, ledger)
        lanes[lane] = (t, r.hmget(mk.lanemeta(inst, lane), ["items", "tokens", "rep"]))
    staged_score = r.zscore(mk.staged, inst)
    return _InstRead(ih, lanes_z, fill, ready, free, None if staged_score is None else float(staged_score),
                     lanes, False)


def verify(r: redis.Redis, model: str, *, items: bool = False, store: Any = None) -> Report:
    """Every counter of ``model`` next to its truth (see the module docstring); the disk tier's
    segments and stored counters too (conductor/verify_store.py; their files when ``store``)."""
    mk = K.ModelKeys(model)
    rep = Report(model)
    rows = rep.rows
    ledger = _Ledger() if items else None
    _oom.on = False
    cfg = _cfg(r, mk)
    found = _classify(r, mk)

    def row(key: str, fld: str, recorded: int, truth: int, kind: str) -> None:
        rows.append(Row(model, key, fld, int(recorded), int(truth), kind))

    # ---- lanes and shape instances: each against the entries it counts
    insts = sorted(found.insts | set(found.lanes) | set(_zset(r, mk.staged)))
    for inst in insts:
        ir = _read_instance(r, mk, inst, found.lanes.get(inst, set()), ledger)
        inst_tokens = inst_items = 0
        # An instance indexed under an older reference contract or mode is re-derived by the next
        # claim that serves it (lib.lua reindex): its fill scores and readiness are not drift.
        current = ir.ih.get("idx") == cfg.index_version or not ir.ih
        if not current:
            rep.notes.append(f"{mk.inst(inst)}: indices follow config {ir.ih.get('idx') or '(none)'}, not "
                             f"{cfg.index_version}; re-derived when served: fill scores and readiness not checked")
        for lane, (t, meta) in ir.lanes.items():
            mkey = mk.lanemeta(inst, lane)
            has_meta = any(v is not None for v in meta)
            m_items, m_tokens, m_rep = (_i(v) for v in meta)
            rep_truth = max(m_rep, t.max_tok)
            inst_tokens += t.tokens
            inst_items += t.items
            if has_meta or t.items or t.tok_len:
                # The token list is the lane's index for claim.lua: as long as the lane, and each
                # token the input_tokens of its record.
                tkey = mk.lane_tok(inst, lane)
                row(tkey, "length", t.tok_len, t.items, "lane.toklen")
                for idx, tok, truth in t.bad:
                    row(tkey, f"token {idx}", tok, truth, "lane.token")
                if t.n_bad > len(t.bad):
                    rep.notes.append(f"{tkey}: {t.n_bad} tokens differ from their records, "
                                     f"the first {len(t.bad)} listed")
                if t.unreadable:
                    rep.problems.append(f"{model}: {mk.lane(inst, lane)} holds {t.unreadable} item record(s) "
                                        "that do not decode as [id, job, input_tokens, ...]")
            if has_meta or t.items:
                row(mkey, "items", m_items, t.items, "lane.items")
                row(mkey, "tokens", m_tokens, t.tokens, "lane.tokens")
                # Lanes only grow: the rep bounds every item, else a memory-mode batch under-pads.
                row(mkey, "rep", m_rep, rep_truth, "lane.rep")
                row(mk.inst_free(inst), f"lane {lane} member", int(lane in ir.free), 0, "free.member")
            if has_meta or lane in ir.lanes_z:
                row(mk.inst_lanes(inst), f"lane {lane} rep", int(ir.lanes_z.get(lane, 0)), m_rep, "lanes.rep")
            in_fill = lane in ir.fill
            row(mk.inst_fill(inst), f"lane {lane} member", int(in_fill), int(t.items > 0), "fill.member")
            if in_fill and t.items and current:
                row(mk.inst_fill(inst), f"lane {lane} score", int(ir.fill[lane]), rep_truth, "fill.score")
            if current:
                row(mk.inst_ready(inst), f"lane {lane} member", int(lane in ir.ready),
                    int(t.items > 0 and cfg.ready(t.items, t.tokens, rep_truth)), "ready.member")
        if ir.ih or inst_items:
            row(mk.inst(inst), "tokens", _i(ir.ih.get("tokens")), inst_tokens, "inst.tokens")
            row(mk.inst(inst), "items", _i(ir.ih.get("items")), inst_items, "inst.items")
        should_stage = ir.ih.get("state", "") in ("staged", "warming")
        if should_stage or ir.staged_score is not None:
            row(mk.staged, f"{inst} member", int(ir.staged_score is not None), int(should_stage), "staged.member")
        if should_stage and ir.staged_score is not None:
            row(mk.staged, f"{inst} score", int(ir.staged_score), _i(ir.ih.get("tokens")), "staged.score")

    # ---- the model's waiting counters against the sum of its instances' counters, in one MULTI
    # (each instance's counters were checked against its lanes above).
    pipe = _Snapshot(r)
    pipe.hmget(mk.intake, ["tokens", "items"])
    for inst in insts:
        pipe.hmget(mk.inst(inst), ["tokens", "items"])
    got = pipe.execute()
    row(mk.intake, "tokens", _i(got[0][0]), sum(_i(x[0]) for x in got[1:]), "state.tokens")
    row(mk.intake, "items", _i(got[0][1]), sum(_i(x[1]) for x in got[1:]), "state.items")

    # ---- in flight and reclaimed: pending entries and the n of each; items inside reclaimed batches
    fl = _read_inflight(r, mk, ledger)
    row(mk.state, "inflight_batches", fl["recorded_batches"], fl["batches"], "state.inflight_batches")
    row(mk.state, "inflight_items", fl["recorded_items"], fl["items"], "state.inflight_items")
    row(mk.batches, "entries not pending", fl["leaked"], 0, "batches.leaked")
    row(mk.state, "reclaimed_items", fl["recorded_reclaimed"], fl["reclaimed"], "state.reclaimed_items")
    # Each reclaimed entry carries a token per item record, in order (claim serves from both).
    row(mk.reclaimed, "tokens listed", fl["reclaimed_tokens"], fl["reclaimed"], "reclaimed.toklen")
    if fl["unreadable"]:
        rep.problems.append(f"{model}: {fl['unreadable']} in-flight or reclaimed item record(s) or reclaimed "
                            "entries do not decode")

    # ---- batch item lists that no pending batch names: a claim or reclaim that stopped halfway
    # (before every script checked its commands first) left its items there, counted nowhere
    orphans = _orphans(r, mk, found.bats)
    row(f"{mk.base}:bat:*", "lists no pending batch names", len(orphans), 0, "bat.orphaned")
    if ledger is not None:
        for token in orphans:
            if _ledger_records(_list(r, mk.batch_items(token)), f"orphan {token}", ledger):
                rep.problems.append(f"{model}: {mk.batch_items(token)} holds item records that do not decode")

    # ---- jobs: counters against the items hash and the results records
    jobs = sorted(found.jobs)
    for job in jobs:
        truth = _job_truth(r, mk, job, ledger)
        row(mk.job_intake(job), "submitted", truth["rec_submitted"], truth["submitted"], "job.submitted")
        if truth["trimmed"]:
            # Retention dropped old records: only their sum is known (one 'd' per result written).
            row(mk.job(job), "completed+failed", truth["rec_completed"] + truth["rec_failed"], truth["done"],
                "job.done")
        else:
            row(mk.job(job), "completed", truth["rec_completed"], truth["completed"], "job.completed")
            row(mk.job(job), "failed", truth["rec_failed"], truth["failed"], "job.failed")
            row(mk.job_items(job), "done (d)", truth["done"], truth["results"], "job.done")
        if truth["dup_results"]:
            rep.problems.append(f"{model}: job {job} has {truth['dup_results']} duplicated result record(s)")
    # ---- the model's job totals against the sum of its jobs' counters, in one MULTI
    pipe = _Snapshot(r)
    pipe.hget(mk.intake, "submitted")
    pipe.hmget(mk.state, ["completed", "failed"])
    for job in jobs:
        pipe.hget(mk.job_intake(job), "submitted")
        pipe.hmget(mk.job(job), ["completed", "failed"])
    got = pipe.execute()
    row(mk.intake, "submitted", _i(got[0]), sum(_i(x) for x in got[2::2]), "state.submitted")
    for i, fld in enumerate(("completed", "failed")):
        row(mk.state, fld, _i(got[1][i]), sum(_i(x[i]) for x in got[3::2]), f"state.{fld}")
    if getattr(_oom, "on", False):
        rep.notes.append("Redis is over maxmemory and refuses MULTI: every read was a plain pipelined read, not "
                         "a snapshot (against a live system, re-check a differing row)")
        _oom.on = False
    from conductor.verify_store import check_store
    check_store(r, mk, jobs, rep, ledger, store)
    if ledger is not None:
        rep.problems.extend(ledger.problems(model))
        rep.ledger = ledger.counts()
        rep.done_lanes = ledger.done_lanes()
    return rep


def _orphans(r: redis.Redis, mk: K.ModelKeys, tokens: set[str]) -> dict[str, tuple[str, dict] | None]:
    """Batch item lists (of the tokens a SCAN found) that no pending batch names, each with the
    batches entry that names its token when one is left (not pending: leaked), else None. The
    pending list is read after the SCAN, and a list a completion deleted meanwhile is skipped."""
    if not tokens:
        return {}
    _b, _n, pending, _bad = _pending(r, mk, None)
    by_token: dict[str, tuple[str, dict]] = {}
    for eid, f in _xrange(r, mk.batches):
        if f.get(b"k"):
            by_token[_s(f[b"k"])] = (_s(eid), f)
    out: dict[str, tuple[str, dict] | None] = {}
    for token in sorted(tokens):
        named = by_token.get(token)
        if named is not None and named[0] in pending:
            continue
        if r.exists(mk.batch_items(token)):
            out[token] = named
    return out


def _ledger_records(recs: Any, place: str, ledger: _Ledger) -> int:
    """Puts each item record of ``recs`` in the ledger at ``place``; returns how many do not decode."""
    bad = 0
    for raw in recs:
        rec = _rec(raw)
        if rec is None:
            bad += 1
        else:
            ledger.add(rec.job, rec.id, place)
    return bad


def _reclaimed_entry(blob: bytes, ledger: _Ledger | None) -> tuple[int, int, int]:
    """One reclaimed entry, msgpack [sig, epoch, lane, deliveries, [tokens], [item records]]:
    (records, tokens, unreadable); the records go to the ledger."""
    try:
        e = _blob_decoder.decode(blob)
        toks, recs = e[4], e[5]
        if not isinstance(toks, list) or not isinstance(recs, list):
            raise TypeError
    except (msgspec.DecodeError, IndexError, KeyError, TypeError):
        return 0, 0, 1
    bad = _ledger_records(recs, "reclaimed", ledger) if ledger is not None else 0
    return len(recs), len(toks), bad


def _read_inflight(r: redis.Redis, mk: K.ModelKeys, ledger: _Ledger | None) -> dict[str, int]:
    """One MULTI when the pending list, the batches stream and the reclaimed list are small
    (they hold what workers have in hand, not the backlog); with the ledger that MULTI also reads
    the pending batches' item lists, whose names (field k) a first read learns. Bounded pages
    otherwise."""
    known: list[str] = []  # k of the batches whose item lists the next MULTI reads
    out: dict[str, int] = {}
    for _attempt in range(3):
        pipe = _Snapshot(r)
        pipe.hmget(mk.state, ["inflight_batches", "inflight_items", "reclaimed_items"])
        pipe.xpending_range(mk.batches, K.GROUP, min="-", max="+", count=SNAPSHOT + 1)
        pipe.xrange(mk.batches, count=SNAPSHOT + 1)
        pipe.lrange(mk.reclaimed, 0, SNAPSHOT)
        for k in known:
            pipe.lrange(mk.batch_items(k), 0, SNAPSHOT)
        res = pipe.execute(raise_on_error=False)
        st, pend, entries, blobs = res[:4]
        if isinstance(pend, Exception):
            if "NOGROUP" not in str(pend):
                raise pend
            pend = []
        for x in (st, entries, blobs, *res[4:]):
            if isinstance(x, Exception):
                raise x
        out = {"recorded_batches": _i(st[0]), "recorded_items": _i(st[1]), "recorded_reclaimed": _i(st[2])}
        if len(pend) > SNAPSHOT or len(entries) > SNAPSHOT or len(blobs) > SNAPSHOT:
            break
        pending = {_s(p["message_id"]) for p in pend}
        items = 0
        ks: list[tuple[str, str]] = []
        for eid, f in entries:
            bid = _s(eid)
            if bid not in pending:
                continue
            items += _i(f.get(b"n"))
            if f.get(b"k"):
                ks.append((bid, _s(f[b"k"])))
        bad = 0
        if ledger is not None:
            if items > SNAPSHOT:
                break
            lists = dict(zip(known, res[4:], strict=True))
            if any(k not in lists for _bid, k in ks):
                known = [k for _bid, k in ks]
                continue  # a batch whose list this MULTI did not read: read again with it
            for bid, k in ks:
                bad += _ledger_records(lists[k], f"batch {bid}", ledger)
        reclaimed = reclaimed_tok = 0
        for blob in blobs:
            n_rec, n_tok, n_bad = _reclaimed_entry(blob, ledger)
            reclaimed += n_rec
            reclaimed_tok += n_tok
            bad += n_bad
        out.update(batches=len(pending), items=items, reclaimed=reclaimed, reclaimed_tokens=reclaimed_tok,
                   unreadable=bad, leaked=sum(1 for eid, _f in entries if _s(eid) not in pending))
        return out
    batches, items, pending, bad = _pending(r, mk, ledger)
    reclaimed, reclaimed_tok, bad_r = _reclaimed(r, mk, ledger)
    out.update(batches=batches, items=items, reclaimed=reclaimed, reclaimed_tokens=reclaimed_tok,
               unreadable=bad + bad_r,
               leaked=sum(1 for eid, _f in _xrange(r, mk.batches) if _s(eid) not in pending))
    return out


def _pending(r: redis.Redis, mk: K.ModelKeys, ledger: _Ledger | None) -> tuple[int, int, set[str], int]:
    """Pending batches in pages: (batches, items, their ids, unreadable item records)."""
    ids: set[str] = set()
    items = bad = 0
    start = "-"
    while True:
        try:
            page = r.xpending_range(mk.batches, K.GROUP, min=start, max="+", count=PENDING_PAGE)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):
                return 0, 0, ids, 0
            raise
        if not page:
            break
        pipe = r.pipeline(transaction=False)
        for p in page:
            pipe.xrange(mk.batches, min=p["message_id"], max=p["message_id"])
        for p, entry in zip(page, pipe.execute(), strict=True):
            bid = _s(p["message_id"])
            ids.add(bid)
            if not entry:
                continue  # a pending entry whose message was deleted counts no items
            f = entry[0][1]
            items += _i(f.get(b"n"))
            if ledger is not None and f.get(b"k"):
                bad += _ledger_records(_list(r, mk.batch_items(_s(f[b"k"]))), f"batch {bid}", ledger)
        if len(page) < PENDING_PAGE:
            break
        start = "(" + _s(page[-1]["message_id"])
    return len(ids), items, ids, bad


def _reclaimed(r: redis.Redis, mk: K.ModelKeys, ledger: _Ledger | None) -> tuple[int, int, int]:
    """The reclaimed list in pages: (item records, tokens, unreadable)."""
    n = n_tok = bad = 0
    i = 0
    while True:
        page = r.lrange(mk.reclaimed, i, i + LIST_PAGE - 1)
        for blob in page:
            n_rec, t, b = _reclaimed_entry(blob, ledger)
            n += n_rec
            n_tok += t
            bad += b
        if len(page) < LIST_PAGE:
            return n, n_tok, bad
        i += LIST_PAGE


def _job_truth(r: redis.Redis, mk: K.ModelKeys, job: str, ledger: _Ledger | None) -> dict[str, int]:
    """A job's counters and their truth. A job of at most SNAPSHOT items and results is read in one
    MULTI; a bigger one counts results up to the last id of a snapshot of its counters, so only
    its id registry (M:in:J:sums) and done marks (M:job:J:items) are read while they may move."""
    fields = ["completed", "failed"]
    pipe = _Snapshot(r)
    pipe.hget(mk.job_intake(job), "submitted")
    pipe.hmget(mk.job(job), fields)
    pipe.hlen(mk.job_sums(job))
    pipe.xlen(mk.job_results(job))
    pipe.xrevrange(mk.job_results(job), count=1)
    rec_sub, rec, n_items, n_results, last = pipe.execute()
    registry: Any
    marks: Any
    records: Any
    if n_items <= SNAPSHOT and n_results <= SNAPSHOT:
        pipe = _Snapshot(r)
        pipe.hget(mk.job_intake(job), "submitted")
        pipe.hmget(mk.job(job), fields)
        pipe.hkeys(mk.job_sums(job))
        pipe.hgetall(mk.job_items(job))
        pipe.xrange(mk.job_results(job))
        rec_sub, rec, registry, marks, records = pipe.execute()
        marks = _pairs(marks)
        # redis-py's cluster pipeline in a transaction leaves XRANGE's fields a flat list
        records = [(eid, dict(_pairs(f))) for eid, f in records]
    else:
        registry = (k for k, _v in r.hscan_iter(mk.job_sums(job), count=PAGE))
        marks = r.hscan_iter(mk.job_items(job), count=PAGE)
        records = _xrange(r, mk.job_results(job), upto=_s(last[0][0]) if last else None) if last else []
    submitted = done = 0
    for iid in registry:
        submitted += 1
        if ledger is not None:
            ledger.state[(job, _s(iid))] = "q"
    for iid, st in marks:
        if _s(st) == "d":
            done += 1
            if ledger is not None:
                ledger.state[(job, _s(iid))] = "d"
    ok = err = results = 0
    seen: set[str] | None = set() if ledger is not None else None
    dup = 0
    for _eid, f in records:
        results += 1
        try:
            res = _result_decoder.decode(f.get(b"r", b""))
        except msgspec.DecodeError:
            err += 1  # an unreadable record is no success
            continue
        if res.error is None:
            ok += 1
        else:
            err += 1
        if seen is not None:
            if res.id in seen:
                dup += 1
            seen.add(res.id)
    if n_items > SNAPSHOT or n_results > SNAPSHOT:
        submitted = n_items  # the snapshot's count, not the pages'
    # Fewer records than done items: retention trimmed the job's results (conductor/retention.py),
    # so the ok/error split of the trimmed ones is gone. (A lost record looks the same.)
    return {"submitted": submitted, "completed": ok, "failed": err, "done": done, "results": results,
            "dup_results": dup, "trimmed": results < done,
            "rec_submitted": _i(rec_sub), "rec_completed": _i(rec[0]), "rec_failed": _i(rec[1])}


def verify_confirmed(r: redis.Redis, model: str, *, items: bool = False, pause_s: float = 0.2) -> Report:
    """Like ``verify``, but a differing row counts only when a second pass finds the same difference.

    Meant for a live system, where one pass can catch a script between two of its reads.
    """
    first = verify(r, model, items=items)
    if first.ok:
        return first
    time.sleep(pause_s)
    second = verify(r, model, items=items)
    seen = {(x.key, x.field, x.diff) for x in first.drift}
    confirmed = {(x.key, x.field) for x in second.drift if (x.key, x.field, x.diff) in seen}
    rows = [x if (x.key, x.field) in confirmed or not x.diff else Row(x.model, x.key, x.field, x.truth, x.truth, x.kind)
            for x in second.rows]
    problems = [p for p in second.problems if p in first.problems]
    return Report(model, rows, problems, second.notes, second.ledger)


# ---------------------------------------------------------------------------- drift gauge

_published: dict[str, set[str]] = {}


def publish_drift(report: Report) -> None:
    """Set the drift gauge per (model, kind of counter); one critical log line when any differs."""
    from conductor import metrics

    kinds = report.by_kind()
    for kind in _published.get(report.model, set()) - set(kinds):
        metrics.DRIFT.labels(report.model, kind).set(0)
    for kind, v in kinds.items():
        metrics.DRIFT.labels(report.model, kind).set(v)
    _published[report.model] = set(kinds)
    if not report.ok:
        log.critical(json.dumps({
            "event": "counter_drift", "model": report.model, "differ": len(report.drift),
            "kinds": {k: v for k, v in kinds.items() if v},
            "rows": [[x.key, x.field, x.recorded, x.truth] for x in report.drift[:EXAMPLES]],
            "problems": report.problems[:EXAMPLES],
            "fix": f"conductor inspect {report.model} --verify --repair"}))


def watch_drift(r: redis.Redis, model: str, *, pause_s: float = 0.5) -> Report:
    """The periodic check (maintenance lease holder): counters only, confirmed by a second pass."""
    report = verify_confirmed(r, model, items=False, pause_s=pause_s)
    publish_drift(report)
    return report


# ---------------------------------------------------------------------------- repair

@dataclass(frozen=True)
class Change:
    key: str
    field: str
    old: str
    new: str


def repair(r: redis.Redis, model: str, *, attempts: int = 5) -> tuple[list[Change], list[str]]:
    """Rewrite ``model``'s counters from the truth. Returns (changes made, what could not be done)."""
    from conductor.scripts import Scripts

    mk = K.ModelKeys(model)
    scripts = Scripts(r)
    changes, failed = repair_items(r, model)
    found = _classify(r, mk)
    staged = _zset(r, mk.staged)
    for inst in sorted(found.insts | set(found.lanes) | set(staged)):
        extra = sorted(found.lanes.get(inst, set()), key=int)
        try:
            out = scripts.repair(keys=[mk.base, mk.cfg, mk.state], args=[inst, *extra])
        except redis.ResponseError as e:
            failed.append(f"{mk.inst(inst)}: {e}")
            continue
        for i in range(0, len(out), 4):
            changes.append(Change(*(_s(x) for x in out[i:i + 4])))
    for _ in range(attempts):
        try:
            changes += _repair_model(r, mk)
            break
        except redis.WatchError:
            time.sleep(0.05)
    else:
        failed.append(f"{mk.state}: the model's state kept changing during {attempts} attempts; "
                      "model and job counters not repaired (retry on a quieter system)")
    return changes, failed


def repair_items(r: redis.Redis, model: str) -> tuple[list[Change], list[str]]:
    """Items put back where they belong (lua/repair_items.lua, one orphaned place per call):

    - a batch list ``M:bat:<token>`` that no pending batch names: its items without a result go to
      the reclaimed list as one batch of their shape (the shape from a leaked batches entry that
      names the token, else the model's only signature; with several and no entry the shape is
      unknown and the list is left for a human), items with a result are dropped, and the leaked
      entry is deleted;
    - a lane whose shape instance is gone (finished): the same;
    - a lane of a live instance: its items that already have a result leave it.

    Items counted queued that are in no place at all cannot be rebuilt: they stay ledger findings.
    Returns (changes, what could not be done); the counters are repaired after this.
    """
    from conductor.scripts import Scripts

    mk = K.ModelKeys(model)
    script = Scripts(r).repair_items
    keys = [mk.base, mk.state, mk.batches, mk.reclaimed]
    changes: list[Change] = []
    failed: list[str] = []

    def run(where: str, args: list[Any]) -> None:
        try:
            moved, cleared, left = (int(x) for x in script(keys=keys, args=args))
        except redis.ResponseError as e:
            failed.append(f"{where}: {e}")
            return
        if moved or cleared:
            changes.append(Change(where, "items", str(moved + cleared + left),
                                  f"{left} ({moved} moved to {mk.reclaimed}, {cleared} with a result cleared)"))

    found = _classify(r, mk)
    orphans = _orphans(r, mk, found.bats)
    for token, named in orphans.items():
        if named is not None:
            eid, f = named
            args = [token, _s(f.get(b"sig", b"")), _i(f.get(b"ep")), _i(f.get(b"lane")), _i(f.get(b"dv")) + 1, eid]
        elif len(found.shapes) == 1:
            sig = next(iter(found.shapes))
            args = [token, sig, _i(r.hget(mk.shape(sig), "epoch")), 0, 1, ""]
        else:
            failed.append(f"{mk.batch_items(token)}: no batches entry names it and the model has "
                          f"{len(found.shapes)} shapes: which shape its items belong to is unknown")
            continue
        run(mk.batch_items(token), ["batch", *args])
    # leaked batches entries (not pending) without a list: deleted by the same call
    _b, _n, pending, _bad = _pending(r, mk, None)
    for eid, f in _xrange(r, mk.batches):
        token = _s(f.get(b"k", b""))
        if _s(eid) not in pending and token and token not in orphans and re.fullmatch(r"[\w.-]{1,64}", token):
            run(f"{mk.batches} {_s(eid)}", ["batch", token, _s(f.get(b"sig", b"0" * 16)), _i(f.get(b"ep")),
                                           _i(f.get(b"lane")), 1, _s(eid)])
    for inst, lanes in sorted(found.lanes.items()):
        if not r.exists(mk.inst(inst)):
            for lane in sorted(lanes, key=int):
                run(mk.lane(inst, lane), ["lane", f"{inst}:{lane}"])
    for where in sorted(verify(r, model, items=True).done_lanes):
        inst, lane = where.rsplit(":", 1)
        if r.exists(mk.inst(inst)):
            run(mk.lane(inst, lane), ["done", where])
    return changes, failed


def _repair_model(r: redis.Redis, mk: K.ModelKeys) -> list[Change]:
    """Model and job counters from the truth, in one WATCH/MULTI transaction.

    Every script that moves these counters writes the model's state hash, so a script that
    runs between the reads and the writes aborts the transaction (WatchError) instead of
    being overwritten; the job keys cover a job written without a count change.
    """
    found = _classify(r, mk)
    jobs_sorted = sorted(found.jobs)
    with r.pipeline(transaction=True) as pipe:
        watch = [mk.state, mk.intake, mk.batches, mk.reclaimed]
        for job in jobs_sorted:
            watch += [mk.job_intake(job), mk.job_sums(job), mk.job(job), mk.job_items(job), mk.job_results(job)]
        pipe.watch(*watch)
        # Reads on the plain client: WATCH sees writes from every connection until EXEC.
        state = {_s(k): _s(v) for k, v in r.hgetall(mk.state).items()}
        state.update({_s(k): _s(v) for k, v in r.hgetall(mk.intake).items()})
        truth: dict[str, int] = {"tokens": 0, "items": 0}
        for inst in sorted(found.insts):
            tok, n = r.hmget(mk.inst(inst), ["tokens", "items"])
            truth["tokens"] += _i(tok)
            truth["items"] += _i(n)
        truth["inflight_batches"], truth["inflight_items"], _ids, _bad = _pending(r, mk, None)
        truth["reclaimed_items"] = _reclaimed(r, mk, None)[0]
        sums = {"submitted": 0, "completed": 0, "failed": 0}
        trimmed = False
        job_rows: list[tuple[str, str, str, int]] = []
        for job in jobs_sorted:
            jt = _job_truth(r, mk, job, None)
            cur = [r.hget(mk.job_intake(job), "submitted"), *r.hmget(mk.job(job), ["completed", "failed"])]
            for fld, v in zip(("submitted", "completed", "failed"), cur, strict=True):
                sums[fld] += jt[fld]
                if jt["trimmed"] and fld != "submitted":
                    trimmed = True
                    continue  # the ok/error split of trimmed records is gone: leave the counters
                if _i(v) != jt[fld]:
                    job_rows.append((job, fld, _s(v) if v is not None else "", jt[fld]))
        if trimmed:
            del sums["completed"], sums["failed"]
        truth.update(sums)
        changes: list[Change] = []
        pipe.multi()
        for fld, v in truth.items():
            if _i(state.get(fld)) != v:
                key = mk.intake if fld in INTAKE_FIELDS else mk.state
                pipe.hset(key, fld, v)
                changes.append(Change(key, fld, state.get(fld, ""), str(v)))
        for job, fld, old, new in job_rows:
            key = mk.job_intake(job) if fld == "submitted" else mk.job(job)
            pipe.hset(key, fld, new)
            changes.append(Change(key, fld, old, str(new)))
        pipe.execute()
    return changes


# ---------------------------------------------------------------------------- command line

_ALWAYS_SHOWN = ("state.", "inst.", "staged.", "job.", "batches.")  # lane-level rows only when they differ


def render(report: Report, *, show_all: bool = False) -> str:
    """Each counter next to its truth; lane-level rows only where they differ unless ``show_all``."""
    drift = report.drift
    out = [f"model {report.model}: {len(report.rows)} counters checked, {len(drift)} differ"
           + (f", {len(report.problems)} ledger finding(s)" if report.problems else "")]
    shown = [r for r in report.rows if show_all or r.diff or r.kind.startswith(_ALWAYS_SHOWN)]
    hidden = len(report.rows) - len(shown)
    if shown:
        wk = max(len(r.key) for r in shown)
        wf = max(len(r.field) for r in shown)
        out.append(f"  {'key':<{wk}}  {'field':<{wf}}  {'recorded':>10}  {'truth':>10}  {'diff':>8}")
        for r in shown:
            mark = "  <-- differs" if r.diff else ""
            out.append(f"  {r.key:<{wk}}  {r.field:<{wf}}  {r.recorded:>10}  {r.truth:>10}  {r.diff:>+8}{mark}")
    if hidden:
        out.append(f"  ({hidden} lane-level counters agree with the truth; --all lists them)")
    out.extend(f"  ledger: {p}" for p in report.problems)
    out.extend(f"  note: {n}" for n in report.notes)
    return "\n".join(out)


def cli_verify(r: redis.Redis, models: list[str], *, do_repair: bool = False, show_all: bool = False,
               ledger: bool = True, as_json: bool = False, store: Any = None, scripts: Any = None) -> int:
    """``conductor inspect --verify [--repair]``: 0 when every counter equals its truth, else 1.

    With ``do_repair`` the counters that differ are rewritten, the changes printed, and the
    exit status tells whether a second verification found everything equal.
    """
    import json

    status = 0
    docs = []
    for model in models:
        report = verify(r, model, items=ledger, store=store)
        doc: dict[str, Any] = {"model": model, "rows": [dict(key=x.key, field=x.field, recorded=x.recorded,
                                                             truth=x.truth, diff=x.diff, kind=x.kind)
                                                        for x in report.rows if show_all or x.diff],
                               "checked": len(report.rows), "differ": len(report.drift),
                               "problems": report.problems, "notes": report.notes}
        if not as_json:
            print(render(report, show_all=show_all))
        if do_repair and not report.ok:
            from conductor.verify_store import repair_store
            answered = repair_store(r, model, store, scripts=scripts) if scripts is not None else []
            changes, failed = repair(r, model)
            after = verify(r, model, items=ledger, store=store)
            doc.update(store_repairs=answered)
            if not as_json:
                for line in answered:
                    print(f"repair of {model}: {line}")
            doc.update(changes=[c.__dict__ for c in changes], repair_failed=failed, after_differ=len(after.drift),
                       after_problems=after.problems)
            if not as_json:
                print(f"repair of {model}: {len(changes)} change(s)")
                for c in changes:
                    print(f"  {c.key}  {c.field}: {c.old or '(absent)'} -> {c.new or '(absent)'}")
                for f in failed:
                    print(f"  not repaired: {f}")
                print(f"after repair: {len(after.drift)} counter(s) differ"
                      + (f", {len(after.problems)} ledger finding(s) a repair cannot settle"
                         if after.problems else ""))
                for x in after.drift:
                    print(f"  {x.key}  {x.field}: recorded {x.recorded}, truth {x.truth}")
            report = after
        if not report.ok:
            status = 1
        docs.append(doc)
    if as_json:
        print(json.dumps(docs))
    elif not models:
        print("no models")
    return status
