"""The producer's path: checks that refuse a submission before its first write, then submit.lua
calls streamed over one connection (SUBMIT_WINDOW in flight), declare and seal."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from conductor.client.core import check_name
from conductor.client.shard_route import Sharding
from conductor.errors import ConductorError, Conflict, DuplicateId, Paused, RedisUnavailable
from conductor.redis_contract import keys as K
from conductor.redis_contract import rules
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.item_record import content_sum, record_head
from conductor.redis_contract.packed_ids import known_sums
from conductor.redis_contract.records import JobClass, PreparedItem

# One submit.lua call blocks Redis for a time per item, so the chunk bounds every other client's
# wait; two calls in flight let the client encode the next call while Redis runs the last one
# (figures: bench/RESULTS.md, "Figures moved from code comments").
SUBMIT_CHUNK = 1000  # items per submit.lua call
SUBMIT_WINDOW = 2  # submit.lua calls in flight on the connection

_pack_in_c: Callable[[tuple[Any, ...]], bytes] | None
try:  # hiredis packs a call's 3,000 arguments in C; redis-py's own pack first copies them in Python
    from hiredis import pack_command as _pack_in_c
except ImportError:  # pragma: no cover - hiredis is a dependency; redis-py works without it
    _pack_in_c = None


def _packed(conn: Any, command: tuple[Any, ...]) -> list[bytes]:
    """``command`` in the wire format, as ``send_packed_command`` takes it (a list of buffers; the
    arguments are str, bytes and int)."""
    return [_pack_in_c(command)] if _pack_in_c is not None else conn.pack_command(*command)


# Replies that say the command did not run, so sending it again is safe: a cluster node
# restarting or failing over, or the key's slot served elsewhere (resharding); and NOSCRIPT.
CLUSTER_REFUSALS = (redis.exceptions.ClusterDownError, redis.exceptions.MovedError, redis.exceptions.AskError,
                    redis.exceptions.TryAgainError)
_REFUSED_BEFORE_RUNNING = (redis.exceptions.NoScriptError, *CLUSTER_REFUSALS)


@dataclass
class SubmitReport:
    accepted: int = 0
    duplicates: int = 0
    models: set[str] = field(default_factory=set)


class Submitting(Sharding):
    def submit(self, items: Iterable[PreparedItem], job: str, *, seal: bool = False,
               progress: Callable[[int], None] | None = None, checked: bool = False,
               idle: Callable[[], None] | None = None) -> SubmitReport:
        """Submit items under ``job``; idempotent on (job, model, item id).

        Items are grouped per model; each submit.lua call takes up to SUBMIT_CHUNK items and
        is all or nothing; SUBMIT_WINDOW calls are in flight at a time. ``seal``: these are the
        last items for now (a whole file): each model's intake counts as quiet at once, so the
        tail of the backlog is dispatched without waiting quiet_ms of silence (seal.lua).

        An id names one item of a job across all its models: an id given for two models, or one
        the job already has under another model, raises DuplicateId before anything is written.
        (submit.lua checks ids per model only: a job's models live in different cluster slots,
        which one script cannot read together. Two producers racing the same id into two models
        of one job are not caught.)
        ``progress`` is called with the number of items answered so far, after every call.
        ``checked``: the caller asked ``check_submit`` and ``check_ids_across_models`` for these
        items before its first write (a file's intake, which sends the file in chunks): they are
        not asked again per chunk. Each submit.lua call still refuses, atomically, what another
        producer wrote meanwhile. ``idle``: the caller's work to do while a reply is awaited
        (calls are in flight then: Redis has work queued); it must not raise.
        """
        check_name("job", job)
        report = SubmitReport()
        by_model: dict[str, list[PreparedItem]] = {}
        for it in items:
            by_model.setdefault(it.model, []).append(it)
        for model in by_model:  # every name checked before the first write
            check_name("model", model)
        by_model = self.route(by_model)  # a sharded model's items to their shards (shard_route.py)
        if not checked:
            self._refuse_before_writing(job, by_model)
        if len(by_model) > 1:
            model_of: dict[str, str] = {}
            for it in (it for its in by_model.values() for it in its):
                first = model_of.setdefault(it.id, it.model)
                if first != it.model:
                    raise DuplicateId(it.id, f"{it.id!r} is given for models {first} and {it.model}: an id "
                                      f"names one item of a job, across its models")
        if not checked:
            self.check_ids_across_models(job, by_model)
        if self.tier is not None and not self._store_probed:
            # A store that refuses writes is found before anything is registered (once per client:
            # a store that fails later stops the submit with what it sent so far, idempotent to re-run).
            self.tier.store.check_writable()
            self._store_probed = True
        for model, its in by_model.items():
            self._register_job(job, model)
            mk = self._intake_model(model)
            report.models.add(model)
            self._submit_model(mk, job, grouped_by_shape(its), report, progress, idle)
        self.ring_model_bell(by_model)
        if seal:
            for model in by_model:
                self.seal(model)
        return report

    def declare(self, job: str, counts: dict[str, int]) -> None:
        """Record, before sending them, how many items (distinct ids) of ``job`` go to each model
        (lua/declare.lua; the stored count only grows): ``status`` then reports items that the
        producer sent and Redis lacks (a failover to a replica that had not received them, an
        interrupted submit) as lost, instead of showing a smaller job as done. With
        wait_replicas the declaration is on the replicas before any item is sent. ``conductor
        submit`` declares a whole file before its first item; a producer of its own calls this
        before ``submit`` (after checking its ids: a declared item that is then refused counts as
        missing)."""
        check_name("job", job)
        for model, n in counts.items():
            if n <= 0:
                continue
            self._register_job(job, model)
            mk = self._intake_model(model)
            self._confirmed(calls.declare(mk, job, n))

    def set_job_class(self, job: str, models: Iterable[str], job_class: JobClass) -> None:
        """The job's tenant, priority and deadline on each of its models (lua/job_class.lua), before
        its first item there: they decide which shape instances take its items. Refused (Conflict)
        when the job has items already under another class."""
        check_name("job", job)
        for model in models:
            for name in dict.fromkeys([model, *self.shards(model)]):  # a sharded model's items go to its shards
                self._confirmed(calls.job_class(self._intake_model(name), job, job_class.tenant, job_class.priority,
                                                job_class.deadline_ms))

    def check_ids_across_models(self, job: str, by_model: dict[str, list[PreparedItem]]) -> None:
        """Refuse ids the job already has under another of its models (one read per 1,000 ids and
        other model; none for a job of one model)."""
        by_model = self.route(by_model)
        known = self.job_models(job)
        for other in known:
            ids = [it.id for model, its in by_model.items() if model != other for it in its]
            for start in range(0, len(ids), 1000):
                chunk = ids[start:start + 1000]
                # the registry, the store-waiting ids and the answered packed ids of that model
                for iid, state in zip(chunk, known_sums(self.r, K.ModelKeys(other), job, chunk), strict=True):
                    if state is not None:
                        raise DuplicateId(iid, f"{iid!r} is already in job {job} under model {other}: an id "
                                          f"names one item of a job, across its models")

    def check_submit(self, items: Iterable[PreparedItem], job: str) -> None:
        """Raise what ``submit`` would refuse before its first write (a paused model, ids the job
        has with other content), for a caller that submits one file in several calls."""
        by_model: dict[str, list[PreparedItem]] = {}
        for it in items:
            by_model.setdefault(it.model, []).append(it)
        self._refuse_before_writing(job, self.route(by_model))

    def check_paused(self, models: Iterable[str]) -> None:
        """Raise Paused when one of ``models`` is paused: all a new job's submission can be refused
        for before its first write."""
        self._refuse_before_writing("", {m: [] for m in models})

    def _refuse_before_writing(self, job: str, by_model: dict[str, list[PreparedItem]]) -> None:
        """Refusals submit.lua would give one call at a time, asked for the whole submission
        first, so a refused file leaves nothing behind (not even an empty job): a paused model,
        and ids the job already has with other content (each call checks again, atomically)."""
        pipe = self.r.pipeline(transaction=False)
        for model in by_model:
            pipe.hget(K.ModelKeys(model).state, "paused")
        pipe.zscore(K.JOBS_KEY, job)
        *paused, created = pipe.execute()
        for model, flag in zip(by_model, paused, strict=True):
            if flag and as_str(flag) == "1":
                raise Paused(f"PAUSED model {model} is paused (conductor resume {model}); nothing submitted")
        if created is None:
            return  # a new job has no ids to conflict with
        conflicts, example = 0, ""
        head = record_head(job)
        for model, its in by_model.items():
            for start in range(0, len(its), rules.MAX_CALL_ITEMS):
                chunk = its[start:start + rules.MAX_CALL_ITEMS]
                # the sum of each id the job has: its registry, its store-waiting ids, its answered
                # packed ids (packed_ids.py)
                known = known_sums(self.r, K.ModelKeys(model), job, [it.id for it in chunk])
                for it, had in zip(chunk, known, strict=True):
                    # '-': an id registered before sums were kept (migrations/0003): not judged
                    if had is not None and had != "-" and had != content_sum(head, it):
                        conflicts += 1
                        example = example or it.id
        if conflicts:
            raise Conflict(f"job {job} already has {conflicts} of these ids with other content (first: "
                           f"{example!r}); nothing submitted: use another job id, or the same content")

    def seal(self, model: str) -> int:
        """Declare the end of this producer's submission to ``model`` (seal.lua), each of its shards."""
        names = self.shards(model)
        sealed = max(calls.seal(K.ModelKeys(name)).run(self.scripts) for name in names)
        self.ring_model_bell(names)
        return sealed

    def _intake_model(self, model: str) -> K.ModelKeys:
        """A model as a producer needs it: in the models set. Its thresholds and consumer group
        are the workers' to create (ensure_model, at registration): submit.lua reads the defaults
        of an unset threshold, and deploy/redis/users.acl gives a producer no write on M:cfg."""
        mk = K.ModelKeys(model)
        if model not in self._models_ready and model not in self._models_listed:
            if not self.r.sismember(K.MODELS_KEY, model):
                self.r.sadd(K.MODELS_KEY, model)
            self._models_listed.add(model)
        return mk

    def _register_job(self, job: str, model: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(K.JOBS_KEY, {job: int(time.time() * 1000)}, nx=True)
        pipe.sadd(K.job_models_key(job), model)
        pipe.execute()

    def _submit_model(self, mk: K.ModelKeys, job: str, its: Sequence[PreparedItem], report: SubmitReport,
                      progress: Callable[[int], None] | None, idle: Callable[[], None] | None = None) -> None:
        """One model's items (grouped by shape) into its lanes; with the disk tier, those beyond the
        model's resident_tokens ceiling into store segments instead (conductor/tier/spill.py)."""
        tier = self.tier
        k = len(its) if tier is None else tier.resident_count(mk, its)
        if k:
            self._submit_calls(mk, job, its[:k], report, progress, idle)
        if tier is not None and k < len(its):
            base = report.accepted + report.duplicates

            def shown(n: int) -> None:
                if progress is not None:
                    progress(base + n)
            accepted, duplicates = tier.write_segments(mk, job, its[k:], self._confirmed, shown if progress else None)
            report.accepted += accepted
            report.duplicates += duplicates

    def _submit_calls(self, mk: K.ModelKeys, job: str, its: Sequence[PreparedItem], report: SubmitReport,
                      progress: Callable[[int], None] | None = None, idle: Callable[[], None] | None = None) -> None:
        """Stream submit.lua calls over one connection, SUBMIT_WINDOW in flight.

        An error reply stops the sending; the calls already sent are read, then the first error
        is raised. A NOSCRIPT reply (script cache flushed mid-run) wrote nothing: that chunk is
        sent again through the Script object, which reloads the script.
        """
        pool = self._pool_for(mk.base)
        again: list[Sequence[PreparedItem]] = []
        try:
            self.r.script_load(self.scripts.submit.script)
            conn = pool.get_connection()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnavailable(f"lost Redis during submit: {e}") from None
        clean = False
        try:
            error = self._stream(conn, mk, job, its, report, again, progress, idle)
            if self.wait_replicas:
                # Also when every item was a duplicate: a re-run after NotReplicated must not
                # return before the replicas have caught up (the pool hands a single producer
                # the connection that made the first writes, and WAIT covers its offset).
                conn.send_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
                self._replicated(conn.read_response())
            clean = True
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnavailable(f"lost Redis during submit: {e}") from None
        finally:
            if not clean:
                conn.disconnect()  # replies may be left unread on it
            pool.release(conn)
        for chunk in again:
            try:
                count_submit_reply(self._confirmed(calls.submit(mk, job, chunk)), report)
            except (ConductorError, redis.ResponseError) as e:  # the first error is raised below
                error = error or e
        if isinstance(error, redis.ResponseError):
            calls.raise_script_error(error)
        if error is not None:
            raise error

    def _stream(self, conn: Any, mk: K.ModelKeys, job: str, its: Sequence[PreparedItem], report: SubmitReport,
                again: list[Sequence[PreparedItem]], progress: Callable[[int], None] | None,
                idle: Callable[[], None] | None = None) -> Exception | None:
        """The chunks sent SUBMIT_WINDOW ahead of their replies; returns the first error reply (the
        sending stops there, the calls already sent are read)."""
        sha = self.scripts.submit.sha
        inflight: deque[Sequence[PreparedItem]] = deque()
        error: Exception | None = None
        for start in range(0, len(its), SUBMIT_CHUNK):
            if error is not None:
                break
            chunk = its[start:start + SUBMIT_CHUNK]
            conn.send_packed_command(_packed(conn, calls.submit(mk, job, chunk).command(sha)), check_health=False)
            inflight.append(chunk)
            if len(inflight) >= SUBMIT_WINDOW:
                if idle is not None:
                    idle()  # while Redis runs the calls in flight
                error = _read_submit_reply(conn, inflight.popleft(), report, again) or error
                if progress:
                    progress(report.accepted + report.duplicates)
        while inflight:
            error = _read_submit_reply(conn, inflight.popleft(), report, again) or error
            if progress:
                progress(report.accepted + report.duplicates)
        return error


def grouped_by_shape(its: list[PreparedItem]) -> list[PreparedItem]:
    """The items with each shape's items together, shapes in order of first appearance and items
    in arrival order within a shape (the only order dispatch keeps: lanes are per shape).

    A submit.lua call pays per lane it touches (two list appends, one hash read and write):
    1,000 items of 20 interleaved shapes touch about one lane per item, 1,000 items of one
    shape a few dozen (bench/RESULTS.md, submit).
    """
    by_sig: dict[str, list[PreparedItem]] = {}
    for it in its:
        by_sig.setdefault(it.sig, []).append(it)
    if len(by_sig) == 1:
        return its
    return [it for group in by_sig.values() for it in group]


def count_submit_reply(reply: list[int], report: SubmitReport) -> None:
    for lane in reply:
        if lane == -1:
            report.duplicates += 1
        else:
            report.accepted += 1


def _read_submit_reply(conn: Any, chunk: Sequence[PreparedItem], report: SubmitReport,
                       again: list[Sequence[PreparedItem]]) -> Exception | None:
    try:
        reply = conn.read_response()
    except redis.ResponseError as e:
        if isinstance(e, _REFUSED_BEFORE_RUNNING):
            again.append(chunk)  # refused before it ran: sent again through the routing client
            return None
        return e
    count_submit_reply(reply, report)
    return None
