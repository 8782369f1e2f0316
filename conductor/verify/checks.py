"""The checks: each level's counters against the level below (lanes against their lists, instances
against their lanes, the model against its instances, batches and jobs, jobs against their items and
results), as rows of a Report; ``verify_confirmed`` keeps only rows a second pass confirms."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.tier.object_store import Store
from conductor.verify.ledger import Ledger, ledger_records
from conductor.verify.snapshot import Snapshot, as_int, classify, list_pages, oom, read_cfg, read_zset
from conductor.verify.tier_truth import EXAMPLES as STORE_EXAMPLES
from conductor.verify.tier_truth import store_truth
from conductor.verify.truth import InstRead, LaneTruth, find_orphans, job_truth, read_inflight, read_instance


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


class _Check:
    """One verify pass over one model: each level's rows, in the order the report shows them."""

    def __init__(self, r: redis.Redis, model: str, items: bool) -> None:
        self.r = r
        self.model = model
        self.mk = K.ModelKeys(model)
        self.rep = Report(model)
        self.ledger = Ledger() if items else None
        oom.on = False
        self.cfg = read_cfg(r, self.mk)
        self.found = classify(r, self.mk)

    def row(self, key: str, fld: str, recorded: int, truth: int, kind: str) -> None:
        self.rep.rows.append(Row(self.model, key, fld, int(recorded), int(truth), kind))

    def instance(self, inst: str) -> None:
        """A shape instance against its lanes, each lane against its record and token lists."""
        mk = self.mk
        ir = read_instance(self.r, mk, inst, self.found.lanes.get(inst, set()), self.ledger)
        # An instance indexed under an older reference contract or mode is re-derived by the next
        # claim that serves it (lib.lua reindex): its fill scores and readiness are not drift.
        current = ir.ih.get("idx") == self.cfg.index_version or not ir.ih
        if not current:
            self.rep.notes.append(
                f"{mk.inst(inst)}: indices follow config {ir.ih.get('idx') or '(none)'}, not "
                f"{self.cfg.index_version}; re-derived when served: fill scores and readiness "
                "not checked"
            )
        for lane, (t, meta) in ir.lanes.items():
            self.lane(inst, lane, t, meta, ir, current)
        inst_tokens = sum(t.tokens for t, _meta in ir.lanes.values())
        inst_items = sum(t.items for t, _meta in ir.lanes.values())
        if ir.ih or inst_items:
            self.row(mk.inst(inst), "tokens", as_int(ir.ih.get("tokens")), inst_tokens, "inst.tokens")
            self.row(mk.inst(inst), "items", as_int(ir.ih.get("items")), inst_items, "inst.items")
        should_stage = ir.ih.get("state", "") in ("staged", "warming")
        if should_stage or ir.staged_score is not None:
            self.row(mk.staged, f"{inst} member", int(ir.staged_score is not None), int(should_stage), "staged.member")
        if should_stage and ir.staged_score is not None:
            self.row(mk.staged, f"{inst} score", int(ir.staged_score), as_int(ir.ih.get("tokens")), "staged.score")

    def lane(self, inst: str, lane: str, t: LaneTruth, meta: list[Any], ir: InstRead, current: bool) -> None:
        """A lane's meta and its entries in the instance's indices against its lists."""
        mk = self.mk
        has_meta = any(v is not None for v in meta)
        m_items, m_tokens, m_rep = (as_int(v) for v in meta)
        rep_truth = max(m_rep, t.max_tok)
        if has_meta or t.items or t.tok_len:
            self.token_list(inst, lane, t)
        if has_meta or t.items:
            mkey = mk.lanemeta(inst, lane)
            self.row(mkey, "items", m_items, t.items, "lane.items")
            self.row(mkey, "tokens", m_tokens, t.tokens, "lane.tokens")
            # Lanes only grow: the rep bounds every item, else a memory-mode batch under-pads.
            self.row(mkey, "rep", m_rep, rep_truth, "lane.rep")
            self.row(mk.inst_free(inst), f"lane {lane} member", int(lane in ir.free), 0, "free.member")
        if has_meta or lane in ir.lanes_z:
            self.row(mk.inst_lanes(inst), f"lane {lane} rep", int(ir.lanes_z.get(lane, 0)), m_rep, "lanes.rep")
        in_fill = lane in ir.fill
        self.row(mk.inst_fill(inst), f"lane {lane} member", int(in_fill), int(t.items > 0), "fill.member")
        if in_fill and t.items and current:
            self.row(mk.inst_fill(inst), f"lane {lane} score", int(ir.fill[lane]), rep_truth, "fill.score")
        if current:
            self.row(
                mk.inst_ready(inst),
                f"lane {lane} member",
                int(lane in ir.ready),
                int(t.items > 0 and self.cfg.ready(t.items, t.tokens, rep_truth)),
                "ready.member",
            )

    def token_list(self, inst: str, lane: str, t: LaneTruth) -> None:
        """The token list is the lane's index for claim.lua: as long as the lane, and each token
        the input_tokens of its record."""
        tkey = self.mk.lane_tok(inst, lane)
        self.row(tkey, "length", t.tok_len, t.items, "lane.toklen")
        for idx, tok, truth in t.bad:
            self.row(tkey, f"token {idx}", tok, truth, "lane.token")
        if t.n_bad > len(t.bad):
            self.rep.notes.append(f"{tkey}: {t.n_bad} tokens differ from their records, the first {len(t.bad)} listed")
        if t.unreadable:
            self.rep.problems.append(
                f"{self.model}: {self.mk.lane(inst, lane)} holds {t.unreadable} item record(s) "
                "that do not decode as [id, job, input_tokens, ...]"
            )

    def model_waiting(self, insts: list[str]) -> None:
        """The model's waiting counters against the sum of its instances' counters, in one MULTI
        (each instance's counters were checked against its lanes)."""
        mk = self.mk
        pipe = Snapshot(self.r)
        pipe.hmget(mk.intake, ["tokens", "items"])
        for inst in insts:
            pipe.hmget(mk.inst(inst), ["tokens", "items"])
        got = pipe.execute()
        self.row(mk.intake, "tokens", as_int(got[0][0]), sum(as_int(x[0]) for x in got[1:]), "state.tokens")
        self.row(mk.intake, "items", as_int(got[0][1]), sum(as_int(x[1]) for x in got[1:]), "state.items")

    def inflight(self) -> None:
        """In flight and reclaimed: pending entries and the n of each; items inside reclaimed batches."""
        mk = self.mk
        fl = read_inflight(self.r, mk, self.ledger)
        self.row(mk.state, "inflight_batches", fl["recorded_batches"], fl["batches"], "state.inflight_batches")
        self.row(mk.state, "inflight_items", fl["recorded_items"], fl["items"], "state.inflight_items")
        self.row(mk.batches, "entries not pending", fl["leaked"], 0, "batches.leaked")
        self.row(mk.state, "reclaimed_items", fl["recorded_reclaimed"], fl["reclaimed"], "state.reclaimed_items")
        # Each reclaimed entry carries a token per item record, in order (claim serves from both).
        self.row(mk.reclaimed, "tokens listed", fl["reclaimed_tokens"], fl["reclaimed"], "reclaimed.toklen")
        if fl["unreadable"]:
            self.rep.problems.append(
                f"{self.model}: {fl['unreadable']} in-flight or reclaimed item record(s) or "
                "reclaimed entries do not decode"
            )

    def orphans(self) -> None:
        """Batch item lists that no pending batch names: a claim or reclaim that stopped halfway
        (before every script checked its commands first) left its items there, counted nowhere."""
        mk = self.mk
        orphans = find_orphans(self.r, mk, self.found.bats)
        self.row(f"{mk.base}:bat:*", "lists no pending batch names", len(orphans), 0, "bat.orphaned")
        if self.ledger is None:
            return
        for token in orphans:
            if ledger_records(list_pages(self.r, mk.batch_items(token)), f"orphan {token}", self.ledger):
                self.rep.problems.append(f"{self.model}: {mk.batch_items(token)} holds item records that do not decode")

    def job(self, job: str) -> None:
        """A job's counters against its items hash and its results records."""
        mk = self.mk
        truth = job_truth(self.r, mk, job, self.ledger)
        self.row(mk.job_intake(job), "submitted", truth["rec_submitted"], truth["submitted"], "job.submitted")
        if truth["trimmed"]:
            # Retention dropped old records: only their sum is known (one 'd' per result written).
            self.row(
                mk.job(job), "completed+failed", truth["rec_completed"] + truth["rec_failed"], truth["done"], "job.done"
            )
        else:
            self.row(mk.job(job), "completed", truth["rec_completed"], truth["completed"], "job.completed")
            self.row(mk.job(job), "failed", truth["rec_failed"], truth["failed"], "job.failed")
            self.row(mk.job_items(job), "done (d)", truth["done"], truth["results"], "job.done")
        if truth["dup_results"]:
            self.rep.problems.append(f"{self.model}: job {job} has {truth['dup_results']} duplicated result record(s)")
        self.job_lifecycle(job, truth)

    def job_lifecycle(self, job: str, truth: dict[str, int]) -> None:
        """A job its lifecycle calls ended (completed, cancelled, expired: conductor/jobs/job_state.py)
        must have a result for every item it holds here: its counts add up."""
        from conductor.jobs.job_state import TERMINAL

        status = as_str(self.r.hget(K.job_meta_key(job), "status") or b"")
        left = truth["submitted"] - truth["done"]
        if status in TERMINAL and left:
            self.rep.problems.append(
                f"{self.model}: job {job} is {status} but {left} of its {truth['submitted']} items here have no result"
            )

    def model_jobs(self, jobs: list[str]) -> None:
        """The model's job totals against the sum of its jobs' counters, in one MULTI."""
        mk = self.mk
        pipe = Snapshot(self.r)
        pipe.hget(mk.intake, "submitted")
        pipe.hmget(mk.state, ["completed", "failed"])
        for job in jobs:
            pipe.hget(mk.job_intake(job), "submitted")
            pipe.hmget(mk.job(job), ["completed", "failed"])
        got = pipe.execute()
        self.row(mk.intake, "submitted", as_int(got[0]), sum(as_int(x) for x in got[2::2]), "state.submitted")
        for i, fld in enumerate(("completed", "failed")):
            self.row(mk.state, fld, as_int(got[1][i]), sum(as_int(x[i]) for x in got[3::2]), f"state.{fld}")

    def store(self, store: Store | None) -> None:
        """The disk tier (verify/tier_truth.py): the stored counters against the stored ids and the
        index records, each stored id placed in its segment, a missing or damaged segment's items."""
        mk = self.mk
        truth = store_truth(self.r, mk, store, self.rep.notes)
        if truth is None:
            return
        self.row(mk.intake, "stored_items", truth.rec_items, truth.items, "state.stored")
        self.row(mk.intake, "stored_tokens", truth.rec_tokens, truth.tokens, "state.stored")
        per_shape = truth.shapes
        for shape, (tokens, segs) in sorted(truth.rec_shapes.items()):
            want = per_shape.get(shape, (0, 0))
            self.row(mk.shape(shape), "stored_tokens", tokens, want[0], "state.stored")
            self.row(mk.shape_segs(shape), "members", segs, want[1], "state.stored")
        if self.ledger is not None:
            for seq, pairs in truth.stored.items():
                for job, iid in pairs:
                    self.ledger.add(job, iid, f"store {seq}")
                    # named in no registry (schema 6): submitted, waiting unless a done mark said otherwise
                    self.ledger.state.setdefault((job, iid), "q")
        for b in truth.bad:
            shown = ", ".join(b.ids[:STORE_EXAMPLES]) + (" ..." if len(b.ids) > STORE_EXAMPLES else "")
            self.rep.problems.append(
                f"{self.model}: store segment {b.name} ({b.rec.get('path')}, job {b.rec.get('job')}) is {b.why}: "
                f"{len(b.ids)} item(s) wait in it: {shown} (--repair answers them with an error result)"
            )

    def finish(self) -> Report:
        rep = self.rep
        if getattr(oom, "on", False):
            rep.notes.append(
                "Redis is over maxmemory and refuses MULTI: every read was a plain pipelined read, not "
                "a snapshot (against a live system, re-check a differing row)"
            )
            oom.on = False
        if self.ledger is not None:
            rep.problems.extend(self.ledger.problems(self.model))
            rep.ledger = self.ledger.counts()
            rep.done_lanes = self.ledger.done_lanes()
        return rep


def verify(r: redis.Redis, model: str, *, items: bool = False, store: Store | None = None) -> Report:
    """Every counter of ``model`` next to its truth (see the package docstring), level by level;
    the disk tier's segments and stored counters too (their files when ``store`` is given)."""
    check = _Check(r, model, items)
    insts = sorted(check.found.insts | set(check.found.lanes) | set(read_zset(r, check.mk.staged)))
    for inst in insts:
        check.instance(inst)
    check.model_waiting(insts)
    check.inflight()
    check.orphans()
    jobs = sorted(check.found.jobs)
    for job in jobs:
        check.job(job)
    check.model_jobs(jobs)
    check.store(store)
    return check.finish()


def verify_confirmed(r: redis.Redis, model: str, *, items: bool = False, pause_s: float = 0.2,
                     store: Store | None = None) -> Report:
    """Like ``verify``, but a differing row counts only when a second pass finds the same difference,
    and a ledger finding only when the second pass finds it too.

    Meant for a live system, where one pass can catch a script between two of its reads (a job or a
    shape instance a submit created after the pass listed them: the model's totals then count it,
    the sum over the listed ones does not).
    """
    first = verify(r, model, items=items, store=store)
    if first.ok:
        return first
    time.sleep(pause_s)
    second = verify(r, model, items=items, store=store)
    seen = {(x.key, x.field, x.diff) for x in first.drift}
    confirmed = {(x.key, x.field) for x in second.drift if (x.key, x.field, x.diff) in seen}
    rows = [
        x if (x.key, x.field) in confirmed or not x.diff else Row(x.model, x.key, x.field, x.truth, x.truth, x.kind)
        for x in second.rows
    ]
    problems = [p for p in second.problems if p in first.problems]
    return Report(model, rows, problems, second.notes, second.ledger)
