"""One typed wrapper per Lua script: its KEYS (from conductor/redis_contract/keys.py), its ARGV, a named reply
type, and ONE error mapping for every script.

A wrapper builds a ``Call``; ``Call.run`` runs it through the registry (conductor/redis_contract/scripts.py) and
maps a refusal to the conductor's errors (``raise_script_error``). The submit stream and the
claim send the same KEYS and ARGV over their own connections (``Call.command``) and map their
error replies with the same function. Each script's header (lua/<name>.lua) is the contract
these wrappers follow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, NoReturn, TypeVar

import redis

from conductor.errors import BadInput, Conflict, Paused, QueueFull
from conductor.redis_contract import keys as K
from conductor.redis_contract import rules
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.item_record import item_record, record_head, record_sum
from conductor.redis_contract.records import Contract, PreparedItem, Result, json_encoder
from conductor.redis_contract.scripts import Scripts
from conductor.redis_contract.segment_record import Segment

R = TypeVar("R")


def raise_script_error(e: Exception) -> NoReturn:
    """A script's error reply as the conductor's error: FULL and OOM -> QueueFull, ERR_ARG ->
    BadInput (naming the field), CONFLICT -> Conflict, PAUSED -> Paused; anything else as it came."""
    msg = str(e)
    if msg.startswith("FULL"):
        raise QueueFull(msg) from None
    # redis-py turns Redis's "OOM ..." reply into OutOfMemoryError and drops the prefix.
    if isinstance(e, redis.OutOfMemoryError) or msg.startswith("OOM"):
        raise QueueFull(f"Redis is full (maxmemory reached, nothing of this call written): {msg}") from None
    if msg.startswith("ERR_ARG"):
        field, _, rest = msg[len("ERR_ARG "):].partition(": ")
        raise BadInput(field, rest) from None
    if msg.startswith("CONFLICT"):
        raise Conflict(msg[len("CONFLICT "):] + "; nothing of this call written") from None
    if msg.startswith("PAUSED"):
        raise Paused(msg) from None
    raise e


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a few us, and the claim makes one per call
class Call(Generic[R]):
    """One script call: the script's name in scripts.NAMES, its KEYS and ARGV, and how its reply reads."""

    script: str
    keys: list[str]
    args: list[Any]
    reply: Callable[[Any], R]

    def run(self, scripts: Scripts) -> R:
        """Run it (EVALSHA, reloading on NOSCRIPT); an error reply raises as raise_script_error maps it."""
        try:
            raw = getattr(scripts, self.script)(keys=self.keys, args=self.args)
        except redis.ResponseError as e:
            raise_script_error(e)
        return self.reply(raw)

    def queue(self, scripts: Scripts, pipe: Any) -> None:
        """Queue it on a pipeline (the reply comes from ``pipe.execute()``, read with ``reply``)."""
        getattr(scripts, self.script)(keys=self.keys, args=self.args, client=pipe)

    def command(self, sha: str) -> tuple[Any, ...]:
        """The EVALSHA command, for a caller that packs it onto a connection of its own."""
        return ("EVALSHA", sha, len(self.keys), *self.keys, *self.args)


def _int(raw: Any) -> int:
    return int(raw)


def _ints(raw: Any) -> list[int]:
    return [int(x) for x in raw]


def _ignored(raw: Any) -> None:
    return None


# ---------------------------------------------------------------------------- model setup

def ensure_model(mk: K.ModelKeys, defaults: Sequence[tuple[str, Any]]) -> Call[None]:
    """lua/ensure_model.lua: config defaults where absent, the batches stream and its group."""
    return Call("ensure_model", [mk.cfg, mk.batches], [x for pair in defaults for x in pair], _ignored)


def reindex(mk: K.ModelKeys, inst: str) -> Call[int]:
    """lua/reindex.lua: 1 when the instance's lane indices were re-derived."""
    return Call("reindex", [mk.base, mk.cfg, mk.state], [inst], _int)


class RegisterReply(NamedTuple):
    set_tokens: bool  # the worker's budget became the model's reference now
    set_items: bool


def register(mk: K.ModelKeys, worker: str, contract_json: str, contract: Contract, now_ms: int,
             ttl_ms: int) -> Call[RegisterReply]:
    """lua/register.lua: a worker's registration and first heartbeat (allow-oom)."""
    return Call("register", [mk.workers, mk.cfg, mk.heartbeat(worker)],
                [worker, contract_json, contract.max_batch_tokens, contract.max_batch_size, now_ms, ttl_ms],
                lambda raw: RegisterReply(bool(int(raw[0])), bool(int(raw[1]))))


def take_name(mk: K.ModelKeys, stem: str, now_ms: int, ttl_ms: int, tries: int = 1000) -> Call[str | None]:
    """lua/take_name.lua: the first free name of ``stem``, ``stem``-2, ... taken with its heartbeat
    key (None when all ``tries`` are live)."""
    # the stem's heartbeat key declared beside base: see the script's KEYS[2]
    return Call("take_name", [mk.base, mk.heartbeat(stem)], [stem, now_ms, ttl_ms, tries],
                lambda raw: None if raw is None else as_str(raw))


def heartbeat(mk: K.ModelKeys, worker: str, now_ms: int, ttl_ms: int, batch_ids: Sequence[str],
              busy_ms: int = 0, holding: bool = False) -> Call[int]:
    """lua/heartbeat.lua: the heartbeat key, the lease of each in-flight batch and the worker's busy
    time; how many of the batches are still pending. ``holding``: the model's holding mark set for the
    TTL too (a sharded model's worker that holds batches on a shard or is about to claim)."""
    keys = [mk.heartbeat(worker), mk.batches, mk.busy]
    return Call("heartbeat", [*keys, mk.holding] if holding else keys, [worker, now_ms, ttl_ms, busy_ms, *batch_ids],
                _int)


class IdleBeat(NamedTuple):
    held: bool  # the caller holds the maintenance lease now
    waits: bool  # a claim could find work: claim now rather than block on the doorbell
    registered: bool  # False: the worker's registration is gone (an emptied server): join again
    # batches pending in the model's group, told to the lease holder when asked (``in_flight=True``);
    # -1 when not asked or not held
    in_flight: int = -1
    # a sharded model's holding mark (some worker holds batches on a shard), told the holder when asked
    holding: bool = False
    # with it, workers whose idle beat here ran out and whose heartbeat is gone (dead): their shard
    # heartbeats, which live a round of the shards, are the holder's to delete
    lapsed: tuple[str, ...] = ()


def idle_beat(mk: K.ModelKeys, worker: str, now_ms: int, ttl_ms: int, lease_ms: int,
              busy_ms: int | None = None, in_flight: bool = False, holding: bool = False) -> Call[IdleBeat]:
    """lua/idle_beat.lua: an idle worker's heartbeat, maintenance lease and "does work wait?" in one
    call; ``busy_ms`` None leaves the busy time as last written; ``in_flight``: the holder is told the
    batches pending too (its sweep's XPENDING); ``holding`` (with ``in_flight``; a sharded model's own
    keys), the model's holding mark and the workers whose idle beats lapsed (this beat indexed in
    ``M:beats``)."""
    keys = [mk.heartbeat(worker), mk.busy, mk.maint_lease, mk.state, mk.intake, mk.hot, mk.workers]
    if in_flight:
        keys += [mk.batches, mk.holding, mk.beats] if holding else [mk.batches]
    return Call("idle_beat", keys, [worker, now_ms, ttl_ms, lease_ms, "" if busy_ms is None else busy_ms],
                lambda raw: IdleBeat(bool(int(raw[0])), bool(int(raw[1])), bool(int(raw[2])), int(raw[3]),
                                     bool(int(raw[4])), tuple(as_str(w) for w in raw[5])))


def schema_init(version: int) -> Call[int]:
    """lua/schema_init.lua: ``version`` written on an empty Redis in one step; the version Redis holds
    then (0: conductor registries without a version, nothing written)."""
    return Call("schema_init", [K.SCHEMA_KEY, K.MODELS_KEY, K.JOBS_KEY], [version], _int)


def lease(key: str, owner: str, ms: int) -> Call[bool]:
    """lua/lease.lua: whether ``owner`` holds the lease ``key`` now (a model's maintenance lease,
    ``ModelKeys.maint_lease``, the expiry lease, ``keys.EXPIRY_LEASE_KEY``, the schema's migration
    lease); ``ms`` 0 hands the caller's lease back (False)."""
    return Call("lease", [key], [owner, ms], lambda raw: bool(int(raw)))


# ---------------------------------------------------------------------------- intake

def submit_args(job: str, chunk: Sequence[PreparedItem]) -> list[Any]:
    """submit.lua's ARGV: the count, the job, then per item its signature, its record as workers
    will read it (keys.py) and its shape's prefix, which travels once per call; last, the items'
    content sums, so that Redis does not spend a SHA-1 per item (its one core is the limit of a
    submit; the producer's SHA-1 runs while Redis runs the previous call)."""
    args: list[Any] = [len(chunk), job]
    head = record_head(job)
    seen: set[str] = set()
    sums = []
    for it in chunk:
        if it.sig in seen:
            prefix = b""
        else:
            seen.add(it.sig)
            prefix = json_encoder.encode(list(it.prefix))
        rec = item_record(it, head)
        sums.append(record_sum(it.sig, rec))
        args += [it.sig, rec, prefix]
    args.append("".join(sums))
    return args


def submit(mk: K.ModelKeys, job: str, chunk: Sequence[PreparedItem]) -> Call[list[int]]:
    """lua/submit.lua: per item the lane it joined, -1 for an id the job had already."""
    return Call("submit", [mk.base, mk.cfg, mk.state], submit_args(job, chunk), _ints)


def declare(mk: K.ModelKeys, job: str, count: int) -> Call[int]:
    """lua/declare.lua: the job's declared item count for this model now (it only grows)."""
    return Call("declare", [mk.job_intake(job), mk.state], [count], _int)


def job_class(mk: K.ModelKeys, job: str, tenant: str, priority: str, deadline_ms: int) -> Call[list[Any]]:
    """lua/job_class.lua: the job's class as stored, [tenant, priority, deadline_ms] (tenant '' : the job)."""
    return Call("job_class", [mk.job_intake(job), mk.state], [tenant, priority, deadline_ms],
                lambda r: [as_str(r[0]), as_str(r[1]), int(r[2])])


class IntakeLease(NamedTuple):
    """lua/intake_lease.lua's reply: whether the caller holds the task now, and its cursor (or why not)."""

    held: bool
    line: int
    sent: int
    state: str  # checking or sending when held; else why not: held, ended, missing, released


def _intake_lease(r: Any) -> IntakeLease:
    if int(r[0]) == 1:
        return IntakeLease(True, int(r[1]), int(r[2]), as_str(r[3]))
    return IntakeLease(False, 0, 0, as_str(r[1]))


def intake_create(task_key: str, owner: str, ms: int, fields: dict[str, str]) -> Call[str]:
    """lua/intake_create.lua: the task recorded with ``owner``'s lease in one step; '' when recorded,
    else the owner whose live lease on the job's open task kept it (nothing written)."""
    pairs = [x for kv in fields.items() for x in kv]
    return Call("intake_create", [task_key], [owner, ms, *pairs], lambda r: "" if int(r[0]) == 1 else as_str(r[1]))


def intake_lease(task_key: str, owner: str, ms: int) -> Call[IntakeLease]:
    """lua/intake_lease.lua: take or renew the lease on a job's intake task (``ms`` 0 hands it back)."""
    return Call("intake_lease", [task_key], [owner, ms], _intake_lease)


def intake_cursor(task_key: str, owner: str, ms: int, line: int, sent: int, state: str = "",
                  **fields: str) -> Call[bool]:
    """lua/intake_cursor.lua: the cursor past ``line`` (``sent`` items), the lease renewed, ``state``
    moved when given; False when the caller no longer holds the task (nothing written)."""
    pairs = [x for kv in fields.items() for x in kv]
    return Call("intake_cursor", [task_key], [owner, ms, line, sent, state, *pairs], lambda r: int(r) == 1)


def batch_finalize(job: str, step: str, at: int, **fields: int) -> Call[bool]:
    """lua/batch_finalize.lua: a batch to finalizing (``step`` 'start') or completed ('done'); False
    when it is not that step's to move (ended, ending, not a batch: nothing written)."""
    pairs = [x for kv in fields.items() for x in kv]
    return Call("batch_finalize", [K.job_meta_key(job)], [step, at, *pairs], lambda r: int(r) == 1)


def tenant_admit(tk: K.TenantKeys, batch: str, tokens: int, limit: int, now_ms: int) -> Call[tuple[bool, int]]:
    """lua/tenant_admit.lua: whether the batch fits the tenant's enqueued-token ``limit`` (0: none),
    counted among its batches when it does; and the tenant's enqueued tokens (with it when admitted)."""
    return Call("tenant_admit", [tk.open, tk.opened], [batch, tokens, limit, now_ms],
                lambda r: (int(r[0]) == 1, int(r[1])))


def seal(mk: K.ModelKeys) -> Call[int]:
    """lua/seal.lua: the seal time (ms, the server's clock)."""
    return Call("seal", [mk.state, mk.intake, mk.doorbell], [], _int)  # the bell wakes a worker at once


# ---------------------------------------------------------------------------- dispatch and writeback

class Claimed(NamedTuple):
    """claim.lua's reply for a batch (its items are read by the LRANGE sent right behind it)."""

    batch_id: str
    sig: str
    epoch: int
    lane: int
    padded_len: int
    claimed_at: int
    flags: int  # 1 cleanup, 2 reclaimed, 4 hygiene
    deliveries: int
    n: int  # the batch's items
    warming: str  # the instance to pre-warm, or ''


class NoBatch(NamedTuple):
    reason: str


def claim_reply(raw: Any) -> Claimed | NoBatch:
    if int(raw[0]) == 0:
        return NoBatch(as_str(raw[1]))
    _, bid, sig, ep, lane, plen, ts, flags, dv, n, warming = raw
    return Claimed(as_str(bid), as_str(sig), int(ep), int(lane), int(plen), int(ts), int(flags), int(dv), int(n),
                   as_str(warming))


def claim(mk: K.ModelKeys, contract: Contract, consumer: str, token: str) -> Call[Claimed | NoBatch]:
    """lua/claim.lua: one batch under ``contract`` moved to the list ``mk.batch_items(token)``."""
    return Call("claim", [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed],
                [consumer, contract.max_batch_size, contract.max_batch_tokens, token],
                claim_reply)


class CompleteReply(NamedTuple):
    written: int  # results written now (one written before is skipped)
    acked: int  # 1 when this call retired the batch


def complete(mk: K.ModelKeys, batch_id: str, results: Sequence[Result], *, final: bool) -> Call[CompleteReply]:
    """lua/complete.lua: results written (idempotent on item id); with ``final`` the batch retired."""
    args: list[Any] = [batch_id, 1 if final else 0, len(results)]
    for res in results:
        args += [res.job, res.id, "err" if res.error else "ok", json_encoder.encode(res)]
    return Call("complete", [mk.base, mk.state, mk.batches], args,
                lambda raw: CompleteReply(int(raw[0]), int(raw[1])))


# ---------------------------------------------------------------------------- failure paths

class FailReply(NamedTuple):
    requeued: int
    dead: int


def fail(mk: K.ModelKeys, batch_id: str, consumer: str, reason: str) -> Call[FailReply]:
    """lua/fail.lua: a batch the engine could not run, given back (or dead-lettered)."""
    return Call("fail", [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed],
                [batch_id, consumer, reason[:rules.MAX_REASON_BYTES]],
                lambda raw: FailReply(int(raw[0]), int(raw[1])))


def hand_over(mk: K.ModelKeys, batch_id: str, consumer: str, token: str) -> Call[int]:
    """lua/hand_over.lua: a claimed batch of an old shard taken out of it into M:moving:<token>."""
    return Call("hand_over", [mk.base, mk.state, mk.batches], [batch_id, consumer, token], _int)


def hand_in(mk: K.ModelKeys, job: str, chunk: Sequence[PreparedItem], deliveries: int) -> Call[int]:
    """lua/hand_in.lua: items of one shape moved from an old shard after ``deliveries - 1``
    deliveries there, into this shard's reclaimed queue with their count; the number taken in."""
    return Call("hand_in", [mk.base, mk.cfg, mk.state, mk.reclaimed], [*submit_args(job, chunk), deliveries], _int)


class ReclaimReply(NamedTuple):
    batches: int
    items: int  # requeued
    dead: int  # dead-lettered
    left: int  # still pending for the consumer
    deleted: int  # 1 when the consumer was deleted


def reclaim(mk: K.ModelKeys, consumer: str, *, force: bool, min_idle_ms: int, count: int) -> Call[ReclaimReply]:
    """lua/reclaim.lua: up to ``count`` of a consumer's pending batches moved to the reclaimed queue."""
    return Call("reclaim", [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed],
                [consumer, 1 if force else 0, min_idle_ms, count], lambda raw: ReclaimReply(*(int(x) for x in raw)))


class DeadRetryReply(NamedTuple):
    retried: int
    skipped: int


def dead_retry(mk: K.ModelKeys, entries: Sequence[str]) -> Call[DeadRetryReply]:
    """lua/dead_retry.lua: dead-lettered entries re-enqueued (served first)."""
    return Call("dead_retry", [mk.base, mk.state, mk.dead, mk.reclaimed], list(entries),
                lambda raw: DeadRetryReply(int(raw[0]), int(raw[1])))


# ---------------------------------------------------------------------------- retention

class TrimReply(NamedTuple):
    batches: int  # batches entries trimmed
    finished: int  # finished entries trimmed
    oldest_pending: str  # '' when none is pending


def trim(mk: K.ModelKeys, finished_keep: int) -> Call[TrimReply]:
    """lua/trim.lua: the batches stream below its oldest pending batch, the finished stream to a length."""
    return Call("trim", [mk.batches, mk.finished], [finished_keep],
                lambda raw: TrimReply(int(raw[0]), int(raw[1]), as_str(raw[2])))


def trim_results(mk: K.ModelKeys, job: str, before_ms: int) -> Call[int]:
    """lua/trim_results.lua: result entries of a finished job trimmed."""
    return Call("trim_results", [mk.job_intake(job), mk.job(job), mk.job_results(job)], [before_ms], _int)


# ---------------------------------------------------------------------------- repair (conductor/verify/)

class Rewritten(NamedTuple):
    key: str
    field: str
    old: str  # '' when absent
    new: str


def repair(mk: K.ModelKeys, inst: str, lanes: Sequence[str]) -> Call[list[Rewritten]]:
    """lua/repair.lua: one shape instance's lanes, metas, indices and counters rewritten from its lanes."""
    return Call("repair", [mk.base, mk.cfg, mk.state], [inst, *lanes],
                lambda raw: [Rewritten(*(as_str(x) for x in raw[i:i + 4])) for i in range(0, len(raw), 4)])


class RepairItemsReply(NamedTuple):
    moved: int  # to the reclaimed list
    cleared: int  # dropped: they have a result
    left: int  # no job of the model knows them


def _repair_items(raw: Any) -> RepairItemsReply:
    return RepairItemsReply(*(int(x) for x in raw))


def repair_items_batch(mk: K.ModelKeys, token: str, sig: str, epoch: int, lane: int, deliveries: int,
                       entry_id: str) -> Call[RepairItemsReply]:
    """lua/repair_items_batch.lua: the items of a batch list no pending batch names put back (as a
    batch of lane ``lane`` of instance ``sig``:``epoch``), and its leaked batches entry ``entry_id``
    ('' : none) deleted."""
    return Call("repair_items_batch", [mk.base, mk.state, mk.batches, mk.reclaimed],
                [token, sig, epoch, lane, deliveries, entry_id], _repair_items)


def repair_items_lane(mk: K.ModelKeys, lane: str) -> Call[RepairItemsReply]:
    """lua/repair_items_lane.lua: the items of a lane ("S:E:L") of a gone instance put back."""
    return Call("repair_items_lane", [mk.base, mk.state, mk.reclaimed], [lane], _repair_items)


def repair_items_done(mk: K.ModelKeys, lane: str) -> Call[RepairItemsReply]:
    """lua/repair_items_done.lua: the items with a result taken out of a lane ("S:E:L") of a live instance."""
    return Call("repair_items_done", [mk.base, mk.state], [lane], _repair_items)


class CancelReply(NamedTuple):
    cursor: str  # the next HSCAN cursor of the job's id registry, '0' when the walk is done
    answered: int  # waiting items given their error result by this step
    in_flight: int  # items skipped because a pending batch holds them


def _cancel_reply(raw: Any) -> CancelReply:
    return CancelReply(as_str(raw[0]), int(raw[1]), int(raw[2]))


def _cancel_keys(mk: K.ModelKeys, job: str) -> list[str]:
    return [mk.base, mk.state, mk.batches, mk.job(job), mk.job_items(job), mk.job_results(job)]


def cancel_registry(mk: K.ModelKeys, job: str, model: str, cursor: str, count: int, code: str,
                    message: str) -> Call[CancelReply]:
    """lua/cancel_registry.lua: one bounded step of cancelling (``code`` cancelled) or expiring a job on
    one model, over about ``count`` ids of its id registry from ``cursor``."""
    return Call("cancel_registry", [*_cancel_keys(mk, job), mk.job_sums(job)],
                [job, model, code, message, cursor, count], _cancel_reply)


def cancel_lane(mk: K.ModelKeys, job: str, model: str, lane: str, code: str, message: str) -> Call[CancelReply]:
    """lua/cancel_lane.lua: the job's waiting items of one lane ("S:E:L") answered, with their input
    tokens and payloads (the cursor comes back '0')."""
    return Call("cancel_lane", _cancel_keys(mk, job), [job, model, code, message, lane], _cancel_reply)


def cancel_segment(mk: K.ModelKeys, job: str, model: str, name: str, code: str, message: str) -> Call[CancelReply]:
    """lua/cancel_segment.lua: the job's ids waiting in store segment ``name`` answered (the cursor
    comes back '0')."""
    return Call("cancel_segment", _cancel_keys(mk, job), [job, model, code, message, name], _cancel_reply)


# ---------------------------------------------------------------------------- the disk tier (conductor/tier/spill.py)

def register_segment(mk: K.ModelKeys, seg: Segment, file_sum: str, ids: Sequence[str],
                     sums: Sequence[str]) -> Call[bool]:
    """lua/register_segment.lua: a store segment written as a file (its SHA-1 ``file_sum``), its
    ids added to the job's stored ids (packed, 16 bytes each) and the segment's id list and counted
    as stored, in one step. True when registered;
    False when a segment of this name was registered already. 'KNOWN <n>' (ids another producer
    registered meanwhile) comes back as the redis.ResponseError it is: the caller looks again."""
    toks = seg.tokens
    args: list[Any] = [seg.name, seg.job, seg.sig, seg.file_name, file_sum, sum(toks), min(toks), max(toks)]
    for iid, sm in zip(ids, sums, strict=True):
        args += [iid, sm]
    return Call("register_segment",
                [mk.intake, mk.job_intake(seg.job), mk.job_sums(seg.job), mk.segs, mk.seg(seg.name), mk.state,
                 mk.job_stored(seg.job), mk.seg_ids(seg.name), mk.base], args,
                lambda raw: int(raw) == 1)


def load_args(seg: Segment) -> list[Any]:
    """submit.lua's ARGV that loads ``seg``: its records as stored, its prefix once (as
    ``submit_args`` sends a call's)."""
    args: list[Any] = [len(seg.records), seg.job]
    prefix = json_encoder.encode(list(seg.prefix))
    for i, rec in enumerate(seg.records):
        args += [seg.sig, rec, prefix if i == 0 else b""]
    args.append("".join(record_sum(seg.sig, rec) for rec in seg.records))  # as submit_args sends them
    return args


def load_segment(mk: K.ModelKeys, seg: Segment) -> Call[list[int]]:
    """lua/submit.lua loading a segment: its ids, registered as stored, join lanes once (a second
    load places nothing: -1 each)."""
    return Call("submit", [mk.base, mk.cfg, mk.state], load_args(seg), _ints)


class FailStoredReply(NamedTuple):
    failed: int  # answered with their error result now
    skipped: int  # no longer waiting in the segment (placed meanwhile): left as they are


def fail_stored(mk: K.ModelKeys, name: str, job: str, answers: Sequence[tuple[str, bytes]]) -> Call[FailStoredReply]:
    """lua/fail_stored.lua: the items of a missing or damaged segment answered with their error
    results (id, result record), and its index record dropped."""
    args: list[Any] = [name]
    for iid, rec in answers:
        args += [iid, rec]
    return Call("fail_stored", [mk.intake, mk.state, mk.segs, mk.seg(name), mk.job_sums(job), mk.job(job),
                                mk.job_items(job), mk.job_results(job), mk.job_stored(job), mk.seg_ids(name), mk.base],
                args,
                lambda raw: FailStoredReply(int(raw[0]), int(raw[1])))


def offload_results(mk: K.ModelKeys, job: str, record: str, eids: Sequence[str]) -> Call[int]:
    """lua/offload_results.lua: the oldest result entries ``eids`` leave the job's stream as their
    segment's ``record`` is registered; the entries moved (0: another offload ran first)."""
    return Call("offload_results", [mk.job_results(job), mk.job_rsegs(job), mk.state], [record, *eids], _int)


def compact_ids(mk: K.ModelKeys, job: str, k: int, ids: Sequence[str]) -> Call[int]:
    """lua/compact_ids.lua: the answered ``ids`` of ``job`` leave its id registry and done marks for
    their packed form (buckets of ``k`` hex digits for a job not packed yet); the ids packed."""
    return Call("compact_ids", [mk.job_items(job), mk.job_sums(job), mk.job_packed(job), mk.state], [k, len(ids), *ids],
                _int)
