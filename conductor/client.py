"""The conductor's Python API: submit, claim, complete, status and results over Redis.

Every state change is one Lua script (lua/); this module only validates, encodes, pipelines
and decodes. It holds no state that Redis does not also hold, so producers, workers and
readers can be separate processes on separate machines.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
import secrets
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec
import redis
from hiredis import pack_command
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from conductor import keys as K
from conductor.config import DEFAULTS
from conductor.errors import BadInput, Conflict, DuplicateId, NotReplicated, Paused, QueueFull, RedisUnavailable
from conductor.formats import PreparedItem
from conductor.records import Batch, BatchItem, Contract, Result, json_encoder
from conductor.schema import check as check_schema
from conductor.scripts import Scripts
from conductor.store import Store
from conductor.tier import Tier

# One submit.lua call blocks Redis for a time per item, so the chunk bounds every other client's
# wait; two calls in flight let the client encode the next call while Redis runs the last one
# (figures: bench/RESULTS.md, "Figures moved from code comments").
SUBMIT_CHUNK = 1000  # items per submit.lua call
SUBMIT_WINDOW = 2  # submit.lua calls in flight on the connection

_items_decoder = msgspec.json.Decoder(list[BatchItem])
_max_tokens = operator.attrgetter("max_tokens")
_item_decoder = msgspec.json.Decoder(BatchItem)


def decode_items(records: list[bytes]) -> list[BatchItem]:
    """Item records (JSON arrays, conductor/keys.py) to BatchItems: one decode call per batch."""
    try:
        return _items_decoder.decode(b"[" + b",".join(records) + b"]")
    except msgspec.DecodeError:
        pass
    # submit.lua checked each body with cjson, which takes a few forms msgspec refuses (NaN,
    # Infinity, hex numbers, leading zeros): the standard library reads the first two; a record
    # neither reads becomes an unreadable item, which the worker answers with an error.
    out = []
    for rec in records:
        try:
            out.append(_item_decoder.decode(rec))
        except msgspec.DecodeError:
            try:
                out.append(msgspec.convert(json.loads(rec), BatchItem))
            except (ValueError, msgspec.ValidationError) as e:
                out.append(_unreadable_item(rec, e))
    return out


def _unreadable_item(rec: bytes, err: Exception) -> BatchItem:
    """An item no decoder reads, still answerable: submit.lua checked with cjson that id and job
    are strings and input_tokens and max_tokens whole numbers, but a producer may write those
    numbers in forms only cjson takes (leading zeros, hex), which are read here the same way."""
    text = rec.decode("utf-8", errors="replace")
    dec = json.JSONDecoder(strict=False)
    head: list[Any] = []
    pos = 1
    for k in range(4):
        pos = len(text) - len(text[pos:].lstrip())
        if k < 2:
            value, pos = dec.raw_decode(text, pos)
        else:
            end = text.index(",", pos)
            value, pos = _lenient_int(text[pos:end]), end
        head.append(value)
        pos = text.index(",", pos) + 1
    iid, job, tok, mt = head
    return BatchItem(id=iid, job=job, input_tokens=tok, max_tokens=mt, prompt="",
                     unreadable=f"the item's record is not JSON this worker can read: {err}")


def _lenient_int(text: str) -> int:
    """A whole number as cjson reads it (strtod: decimal with leading zeros, fraction, exponent,
    hex); 0 when even that fails, so the item is still answered."""
    t = text.strip()
    for conv in (int, lambda x: int(x, 16), float):
        try:
            return int(conv(t))
        except (ValueError, OverflowError):
            continue
    return 0


def connect(url: str, *, timeout: float = 10.0) -> redis.Redis:
    """A client with bounded-backoff reconnects; raises RedisUnavailable with one clear line.

    ``?cluster=1`` on the URL (any node of a Redis Cluster) gives a cluster client: every key of
    a model lives in one slot, so each script runs on the node that owns it.
    """
    shown = redact_url(url)
    url, cluster = _cluster_flag(url)
    try:
        _refuse_bad_credentials_at_once(url, timeout)
        if cluster:
            client = redis.RedisCluster.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout,
                retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8))
            client.ping()
            return client  # type: ignore[return-value]
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
            # CLUSTERDOWN: a cluster node refused the command before running it (a restart or a
            # failover in progress), so sending it again is safe.
            retry_on_error=[redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError],
            health_check_interval=30,
        )
        client.ping()
    except ValueError as e:
        raise RedisUnavailable(f"bad Redis URL {shown!r}: {e}") from None
    except redis.AuthenticationError as e:
        raise RedisUnavailable(f"Redis at {shown} refused the credentials: {e}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        raise RedisUnavailable(f"cannot reach Redis at {shown}: {e}") from None
    return client


def _cluster_flag(url: str) -> tuple[str, bool]:
    """The URL without its ``cluster`` query argument, and whether it asked for a cluster."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    flags = [v for k, v in query if k == "cluster"]
    if not flags:
        return url, False
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "cluster"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), flags[-1].lower() in ("1", "true", "yes")


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def _refuse_bad_credentials_at_once(url: str, timeout: float) -> None:
    # redis-py's AuthenticationError is a ConnectionError, so the retrying client would spend
    # its whole backoff (tens of seconds) on a wrong password: ask once, without retries.
    probe = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                 retry=Retry(NoBackoff(), 0))
    try:
        probe.ping()
    except redis.AuthenticationError:
        raise
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        if "CERTIFICATE_VERIFY_FAILED" in str(e) or "WRONG_VERSION_NUMBER" in str(e):
            raise RedisUnavailable(f"TLS with Redis at {redact_url(url)} failed (check ssl_ca_certs, and "
                                   f"rediss:// against a TLS port): {e}") from None
        # down or restarting: the retrying client waits for it
    finally:
        probe.close()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class SubmitReport:
    accepted: int = 0
    duplicates: int = 0
    models: set[str] = field(default_factory=set)


class Conductor:
    """One client of one Redis; cheap to create, safe to use from one thread at a time."""

    def __init__(self, client: redis.Redis, *, migrate: bool = True, wait_replicas: int = 0,
                 wait_timeout_ms: int = 1000, store: Store | None = None) -> None:
        """``wait_replicas``: submit and complete return only once that many replicas hold
        their writes (WAIT), else raise NotReplicated: with asynchronous replication a failover
        may otherwise lose writes the old primary acknowledged. ``store``: the disk tier's
        (conductor/tier.py), used for models with a resident_tokens ceiling."""
        self.r = client
        self.tier = Tier(self, store) if store is not None else None
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.scripts = Scripts(client)
        check_schema(client, auto=migrate)
        self._models_ready: set[str] = set()
        self._models_listed: set[str] = set()
        self._prefix_cache: dict[tuple[str, str], list[str]] = {}
        # the claim's own connection, per server (one, or one per cluster node that holds a model)
        # keyed by the pool itself, not id(): a pool dropped after a slot-map refresh stays
        # referenced here, so its id is never reused for another node's pool
        self._hot_conns: dict[redis.ConnectionPool, redis.connection.AbstractConnection] = {}
        # (model, consumer) -> tokens of claims whose reply was lost (see claim)
        self._lost_claims: dict[tuple[str, str], list[str]] = {}

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> Conductor:
        return cls(connect(url), **kw)

    # ------------------------------------------------------------------ models
    def ensure_model(self, model: str, force: bool = False) -> K.ModelKeys:
        mk = K.ModelKeys(model)
        if model in self._models_ready and not force:
            return mk
        # The reference budget is the first worker's contract (seed 001), set when it registers.
        args = [x for name, value in DEFAULTS.items() if name not in ("budget_tokens", "budget_items")
                for x in (name, value)]
        # One allow-oom script (lua/ensure_model.lua), not HSETNX and XGROUP CREATE: over maxmemory
        # Redis refuses those (even when they would change nothing), and a fresh worker must still
        # register to drain a full Redis. The models set is in another slot: read first, so that a
        # known model writes nothing there.
        try:
            self.scripts.ensure_model(keys=[mk.cfg, mk.batches], args=args)
        except redis.ResponseError as e:
            _raise_script_error(e)
        if not self.r.sismember(K.MODELS_KEY, model):
            self.r.sadd(K.MODELS_KEY, model)
        self._models_ready.add(model)
        return mk

    def pause(self, model: str) -> None:
        """Every script that writes this model's keys refuses until resume (workers ride it out,
        producers get Paused): its keys may then move between cluster nodes, or be migrated,
        with nothing half-written. Batches in flight stay in flight."""
        self.r.hset(self.ensure_model(model).state, "paused", 1)

    def resume(self, model: str) -> None:
        self.r.hdel(self.ensure_model(model).state, "paused")

    def set_config(self, model: str, values: dict[str, Any]) -> None:
        mk = self.ensure_model(model)
        if values:
            self.r.hset(mk.cfg, mapping=values)
            if {"budget_tokens", "budget_items", "mode"} & set(values):
                self.reindex(model)

    def reindex(self, model: str) -> int:
        """Re-derive lane indices of every waiting shape instance after the reference contract or
        mode changed; returns how many instances were re-derived (claim also does it lazily)."""
        mk = K.ModelKeys(model)
        insts = {_s(i) for i in self.r.zrange(mk.staged, 0, -1)} | {_s(i) for i in self.r.zrange(mk.active, 0, -1)}
        legacy = self.r.hget(mk.state, "active")  # schema before M:active: claim.lua moves it there
        if legacy:
            insts.add(_s(legacy))
        try:
            return sum(int(self.scripts.reindex(keys=[mk.base, mk.cfg, mk.state], args=[i])) for i in insts if i)
        except redis.ResponseError as e:
            _raise_script_error(e)
            raise

    def config(self, model: str) -> dict[str, str]:
        mk = K.ModelKeys(model)
        return {_s(k): _s(v) for k, v in self.r.hgetall(mk.cfg).items()}

    def models(self) -> list[str]:
        return sorted(_s(m) for m in self.r.smembers(K.MODELS_KEY))

    # ------------------------------------------------------------------ submit
    def submit(self, items: Iterable[PreparedItem], job: str, *, seal: bool = False,
               progress: Callable[[int], None] | None = None) -> SubmitReport:
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
        """
        _check_name("job", job)
        report = SubmitReport()
        by_model: dict[str, list[PreparedItem]] = {}
        for it in items:
            by_model.setdefault(it.model, []).append(it)
        for model in by_model:  # every name checked before the first write
            _check_name("model", model)
        self._refuse_before_writing(job, by_model)
        if len(by_model) > 1:
            model_of: dict[str, str] = {}
            for it in (it for its in by_model.values() for it in its):
                first = model_of.setdefault(it.id, it.model)
                if first != it.model:
                    raise DuplicateId(it.id, f"{it.id!r} is given for models {first} and {it.model}: an id "
                                      f"names one item of a job, across its models")
        self.check_ids_across_models(job, by_model)
        for model, its in by_model.items():
            self._register_job(job, model)
            mk = self._intake_model(model)
            report.models.add(model)
            if self.tier is not None:
                self.tier.submit_model(mk, job, _grouped_by_shape(its), report, progress)
            else:
                self._submit_calls(mk, job, _grouped_by_shape(its), report, progress)
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
        _check_name("job", job)
        for model, n in counts.items():
            if n <= 0:
                continue
            self._register_job(job, model)
            mk = self._intake_model(model)
            try:
                self._confirmed(self.scripts.declare, [mk.job_intake(job), mk.state], [n])
            except redis.ResponseError as e:
                _raise_script_error(e)
                raise

    def check_ids_across_models(self, job: str, by_model: dict[str, list[PreparedItem]]) -> None:
        """Refuse ids the job already has under another of its models (one read per 1,000 ids and
        other model; none for a job of one model)."""
        known = self.job_models(job)
        for other in known:
            ids = [it.id for model, its in by_model.items() if model != other for it in its]
            key = K.ModelKeys(other).job_sums(job)  # the job's id registry for that model
            for start in range(0, len(ids), 1000):
                chunk = ids[start:start + 1000]
                for iid, state in zip(chunk, self.r.hmget(key, chunk), strict=True):
                    if state is not None:
                        raise DuplicateId(iid, f"{iid!r} is already in job {job} under model {other}: an id "
                                          f"names one item of a job, across its models")
    def check_submit(self, items: Iterable[PreparedItem], job: str) -> None:
        """Raise what ``submit`` would refuse before its first write (a paused model, ids the job
        has with other content), for a caller that submits one file in several calls."""
        by_model: dict[str, list[PreparedItem]] = {}
        for it in items:
            by_model.setdefault(it.model, []).append(it)
        self._refuse_before_writing(job, by_model)

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
            if flag and _s(flag) == "1":
                raise Paused(f"PAUSED model {model} is paused (conductor resume {model}); nothing submitted")
        if created is None:
            return  # a new job has no ids to conflict with
        conflicts, example = 0, ""
        head = _record_head(job)
        for model, its in by_model.items():
            sums_key = K.ModelKeys(model).job_sums(job)
            for start in range(0, len(its), 5000):
                chunk = its[start:start + 5000]
                for it, had in zip(chunk, self.r.hmget(sums_key, [it.id for it in chunk]), strict=True):
                    # '-': an id registered before sums were kept (migrations/0003): not judged;
                    # 's<seq>:<sum>': an id waiting in a store segment (lua/register_segment.lua)
                    if had is not None and had != b"-" and _s(had)[-16:] != content_sum(head, it):
                        conflicts += 1
                        example = example or it.id
        if conflicts:
            raise Conflict(f"job {job} already has {conflicts} of these ids with other content (first: "
                           f"{example!r}); nothing submitted: use another job id, or the same content")

    def seal(self, model: str) -> int:
        """Declare the end of this producer's submission to ``model`` (seal.lua)."""
        try:
            mk = K.ModelKeys(model)
            return int(self.scripts.seal(keys=[mk.state, mk.intake]))
        except redis.ResponseError as e:
            _raise_script_error(e)
            raise

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

    def _submit_calls(self, mk: K.ModelKeys, job: str, its: Sequence[PreparedItem], report: SubmitReport,
                      progress: Callable[[int], None] | None = None) -> None:
        """Stream submit.lua calls over one connection, SUBMIT_WINDOW in flight.

        An error reply stops the sending; the calls already sent are read, then the first error
        is raised. A NOSCRIPT reply (script cache flushed mid-run) wrote nothing: that chunk is
        sent again through the Script object, which reloads the script.
        """
        script = self.scripts.submit
        keys = [mk.base, mk.cfg, mk.state]
        pool = self._pool_for(mk.base)
        inflight: deque[Sequence[PreparedItem]] = deque()
        again: list[Sequence[PreparedItem]] = []
        error: Exception | None = None
        try:
            self.r.script_load(script.script)
            conn = pool.get_connection()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise RedisUnavailable(f"lost Redis during submit: {e}") from None
        clean = False
        try:
            for start in range(0, len(its), SUBMIT_CHUNK):
                if error is not None:
                    break
                chunk = its[start:start + SUBMIT_CHUNK]
                conn.send_packed_command(conn.pack_command(
                    "EVALSHA", script.sha, len(keys), *keys, *_submit_args(job, chunk)), check_health=False)
                inflight.append(chunk)
                if len(inflight) >= SUBMIT_WINDOW:
                    error = _read_submit_reply(conn, inflight.popleft(), report, again) or error
                    if progress:
                        progress(report.accepted + report.duplicates)
            while inflight:
                error = _read_submit_reply(conn, inflight.popleft(), report, again) or error
                if progress:
                    progress(report.accepted + report.duplicates)
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
                _count_submit_reply(self._confirmed(script, keys, _submit_args(job, chunk)), report)
            except redis.ResponseError as e:
                error = error or e
        if error is not None:
            _raise_script_error(error)

    # ------------------------------------------------------------------ claim
    def claim(self, contract: Contract, consumer: str) -> tuple[Batch | None, str]:
        """One batch under ``contract`` for ``consumer``, or (None, reason).

        One round trip: claim.lua moves the batch's items into a list named by a fresh token and
        the LRANGE pipelined behind it reads them, so item bytes never pass through Lua. After a
        claim that raised on a dropped connection, the next call first returns that claim's batch
        if the script had run (reason "recovered").
        """
        mk = self.ensure_model(contract.model)
        if self._lost_claims.get((contract.model, consumer)):
            found = self._recover_lost_claim(contract.model, consumer)
            if found is not None:
                return found, "recovered"
        script = self.scripts.claim
        for _attempt in range(3):
            token = secrets.token_hex(8)
            try:
                reply, raw = self._send_two(
                    ("EVALSHA", script.sha, 5, mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed, consumer,
                     contract.max_batch_size, contract.max_batch_tokens, contract.max_input_len, token),
                    ("LRANGE", mk.batch_items(token), 0, -1))
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                # The script may have run and only its reply been lost: its batch would then sit
                # in this consumer's pending list, unknown to it, until the stale sweep (minutes).
                # The token names it: the next claim looks it up first.
                lost = self._lost_claims.setdefault((contract.model, consumer), [])
                lost.append(token)
                del lost[:-16]
                raise
            if isinstance(reply, redis.exceptions.NoScriptError):
                self.r.script_load(script.script)  # a restart or SCRIPT FLUSH emptied the cache
                continue
            if isinstance(reply, _CLUSTER_REFUSALS):
                # Refused before it ran (the LRANGE read nothing): a cluster restarting, or the
                # model's slot moved to another node (resharding), whose pool the next try uses.
                if isinstance(self.r, redis.RedisCluster) and isinstance(reply, redis.exceptions.MovedError):
                    self.r.nodes_manager.initialize()
                time.sleep(0.05 * (_attempt + 1))
                continue
            if isinstance(reply, redis.ResponseError):
                if "NOGROUP" in str(reply):
                    self.ensure_model(contract.model, force=True)
                    return None, "nogroup"
                if "is in use by a pending batch" in str(reply):
                    continue
                _raise_script_error(reply)
            if isinstance(raw, Exception):
                raise raw
            break
        else:
            if isinstance(reply, _CLUSTER_REFUSALS):
                raise reply  # still refused: the worker rides it out (workers/transient.py)
            raise RuntimeError("claim.lua: no usable reply after 3 attempts")
        if reply[0] == 0:
            return None, _s(reply[1])
        _, bid, sig, ep, lane, plen, ts, flags, dv, n, warming = reply
        if len(raw) != n:
            # Only a reclaim between the script and the read (a lost lease) empties the list;
            # the items are then in the reclaimed queue, nothing is lost.
            return None, "raced"
        return self._batch(contract.model, bid, sig, ep, lane, plen, ts, flags, dv, raw, warming), "batch"

    def _batch(self, model: str, bid: Any, sig: Any, ep: Any, lane: Any, plen: Any, ts: Any, flags: int,
               dv: int, raw: list[bytes], warming: Any) -> Batch:
        items = decode_items(raw)
        if dv > 1:
            for it in items:
                it.deliveries = dv
        sig = _s(sig)
        return Batch(model=model, batch_id=_s(bid), shape=sig, epoch=int(ep), lane=int(lane),
                     padded_len=int(plen), max_tokens=max(map(_max_tokens, items)), claimed_at=int(ts),
                     items=items, prefix=self.prefix(model, sig), cleanup=bool(flags & 1),
                     reclaimed=bool(flags & 2), hygiene=bool(flags & 4), warming=_s(warming))

    def _recover_lost_claim(self, model: str, consumer: str) -> Batch | None:
        """The batch of a claim whose reply was lost, if the script ran: found by its token among
        the consumer's pending entries (a worker holds a few). A token not found there was never
        run, was lost with a Redis restart, or was reclaimed already: it is forgotten."""
        lost = self._lost_claims[(model, consumer)]
        mk = K.ModelKeys(model)
        pending = self.r.xpending_range(mk.batches, "workers", min="-", max="+", count=10_000,
                                        consumername=consumer)
        pipe = self.r.pipeline(transaction=False)
        for p in pending:
            pipe.xrange(mk.batches, p["message_id"], p["message_id"])
        found: tuple[Any, dict] | None = None
        for entry in pipe.execute():
            if entry and _s(entry[0][1].get(b"k", b"")) in lost:
                found = entry[0]
                break
        if found is None:
            lost.clear()
            return None
        bid, f = found
        token = _s(f[b"k"])
        lost.remove(token)
        raw = self.r.lrange(mk.batch_items(token), 0, -1)
        if len(raw) != int(f[b"n"]):
            return None  # reclaimed meanwhile: its items are in the reclaimed queue
        return self._batch(model, bid, f[b"sig"], f[b"ep"], f[b"lane"], f[b"plen"], f[b"ts"], int(f[b"fl"]),
                           int(f[b"dv"]), raw, "")

    def _pool_for(self, key: str) -> redis.ConnectionPool:
        """The connection pool of the server holding ``key``: the client's own, or on a Redis
        Cluster the pool of the node that owns the key's slot (a model's keys share one slot)."""
        if isinstance(self.r, redis.RedisCluster):
            return self.r.get_node_from_key(key).redis_connection.connection_pool
        return self.r.connection_pool

    def _send_two(self, first: tuple, second: tuple) -> tuple[Any, Any]:
        """Two commands in one round trip, replies (or their errors) returned undecoded.

        Straight on a connection of its own, packed by hiredis, rather than through a redis-py
        pipeline and the pool: the claim is the hot call of every worker, and that bookkeeping
        cost a third of the script's server time (bench/RESULTS.md). A
        dropped connection raises, as a pipeline's would; claims are not retried blindly (the
        script may have run): the worker rides the error out and its next claim looks the lost
        batch up by its token (``_recover_lost_claim``).
        """
        pool = self._pool_for(first[3])  # the script's first key
        conn = self._hot_conns.get(pool)
        if conn is None:
            # Checked out for good: the pool still owns it, so closing the client closes it.
            conn = self._hot_conns[pool] = pool.get_connection()
        try:
            # A connection the server closed (a restart) reads as readable: open a fresh one, as
            # the pool does, so a restart costs no claim. Connecting retries with backoff.
            stale = conn.can_read()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            stale = True
        if stale:
            conn.disconnect()
        try:
            conn.send_packed_command([pack_command(first) + pack_command(second)])
            out: list[Any] = []
            for _ in range(2):
                try:
                    out.append(conn.read_response())
                except redis.ResponseError as e:  # the reply was read whole: the next one follows
                    out.append(e)
        except BaseException:
            conn.disconnect()  # the next call connects again
            raise
        return out[0], out[1]

    def prewarm_info(self, model: str, inst: str) -> tuple[str, int, list[int]]:
        """(shape, epoch, padded lengths of its lanes) of a warming instance, for engine.prewarm."""
        mk = K.ModelKeys(model)
        sig, _, ep = inst.partition(":")
        reps = self.r.zrange(mk.inst_lanes(inst), 0, -1, withscores=True)
        return sig, int(ep), sorted({-(-int(rep) // 8) * 8 for _, rep in reps})

    def prefix(self, model: str, sig: str) -> list[str]:
        key = (model, sig)
        cached = self._prefix_cache.get(key)
        if cached is None:
            raw = self.r.hget(K.ModelKeys(model).shape(sig), "prefix")
            cached = msgspec.json.decode(raw) if raw else []
            if len(self._prefix_cache) > 4096:
                self._prefix_cache.clear()
            self._prefix_cache[key] = cached
        return cached

    # ------------------------------------------------------------------ complete
    def complete(self, batch: Batch, results: Sequence[Result], *, final: bool = True) -> tuple[int, int]:
        """Write results (idempotent on item id); with ``final`` ack and delete the batch."""
        mk = K.ModelKeys(batch.model)
        args: list[Any] = [batch.batch_id, 1 if final else 0, len(results)]
        for res in results:
            args += [res.job, res.id, "err" if res.error else "ok", json_encoder.encode(res)]
        try:
            written, acked = self._confirmed(self.scripts.complete, [mk.base, mk.state, mk.batches], args)
        except redis.ResponseError as e:
            _raise_script_error(e)
        return int(written), int(acked)

    def _confirmed(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """The script's reply; with wait_replicas, once its writes reached that many replicas
        (WAIT runs on the connection that wrote them: a pipeline keeps the two together)."""
        if not self.wait_replicas:
            return script(keys=keys, args=args)
        pipe = self.r.pipeline(transaction=False)
        script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
        reply, acked = pipe.execute()
        self._replicated(acked)
        return reply

    def _replicated(self, acked: Any) -> None:
        if int(acked) < self.wait_replicas:
            raise NotReplicated(f"{acked} of {self.wait_replicas} replicas confirmed the write within "
                                f"{self.wait_timeout_ms} ms; it is on the primary, and sending it again is safe")

    # ------------------------------------------------------------------ failure paths
    def fail(self, batch: Batch, consumer: str, reason: str) -> tuple[int, int]:
        """Give back a batch the engine could not run: (items requeued, items dead-lettered)."""
        mk = K.ModelKeys(batch.model)
        try:
            k, d = self.scripts.fail(keys=[mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed],
                                     args=[batch.batch_id, consumer, reason[:4096]])
        except redis.ResponseError as e:
            _raise_script_error(e)
        return int(k), int(d)

    def reclaim_consumer(self, model: str, consumer: str, *, force: bool = False,
                         min_idle_ms: int = 0, count: int = 100) -> dict[str, int]:
        """Move ``consumer``'s pending batches to the reclaimed queue if it is dead (or ``force``)."""
        mk = K.ModelKeys(model)
        total = {"batches": 0, "items": 0, "dead": 0, "left": 0, "deleted": 0}
        while True:
            try:
                b, k, d, left, deleted = self.scripts.reclaim(
                    keys=[mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed],
                    args=[consumer, 1 if force else 0, min_idle_ms, count])
            except redis.ResponseError as e:
                _raise_script_error(e)
            total["batches"] += int(b)
            total["items"] += int(k)
            total["dead"] += int(d)
            total["left"] = int(left)
            total["deleted"] = int(deleted)
            if int(b) < count:
                return total

    def consumers(self, model: str) -> list[dict[str, Any]]:
        mk = K.ModelKeys(model)
        try:
            rows = self.r.xinfo_consumers(mk.batches, K.GROUP)
        except redis.ResponseError:
            return []
        out = []
        for row in rows:
            row = {_s(k): (_s(v) if isinstance(v, bytes) else v) for k, v in row.items()}
            row["alive"] = bool(self.r.exists(mk.heartbeat(row["name"])))
            out.append(row)
        return out

    def reclaim_dead(self, model: str, *, min_idle_ms: int = 0) -> dict[str, int]:
        """One reclaim sweep over every consumer of ``model`` without a live heartbeat."""
        total = {"consumers": 0, "batches": 0, "items": 0, "dead": 0}
        for row in self.consumers(model):
            if row["alive"] and not min_idle_ms:
                continue
            res = self.reclaim_consumer(model, row["name"], min_idle_ms=min_idle_ms)
            if res["batches"] or res["deleted"]:
                total["consumers"] += 1
            for k in ("batches", "items", "dead"):
                total[k] += res[k]
        return total

    # ------------------------------------------------------------------ jobs
    def job_models(self, job: str) -> list[str]:
        return sorted(_s(m) for m in self.r.smembers(K.job_models_key(job)))

    def status(self, job: str, models: list[str] | None = None) -> dict[str, Any]:
        """Counters of ``job`` over its models (``models``: the job's models when already read)."""
        models = self.job_models(job) if models is None else models
        total = {"job": job, "submitted": 0, "completed": 0, "failed": 0, "pending": 0, "declared": 0, "lost": 0,
                 "models": {}}
        pipe = self.r.pipeline(transaction=False)
        for model in models:
            pipe.hmget(K.ModelKeys(model).job_intake(job), "submitted", "declared")
            pipe.hmget(K.ModelKeys(model).job(job), "completed", "failed")
        got = pipe.execute() if models else []
        for i, model in enumerate(models):
            (sub, dec), (comp, fail) = got[2 * i], got[2 * i + 1]
            row = {"submitted": int(sub or 0), "completed": int(comp or 0), "failed": int(fail or 0),
                   "declared": int(dec or 0)}
            row["pending"] = row["submitted"] - row["completed"] - row["failed"]
            # Items the producer declared before sending them and Redis does not hold (declare.lua).
            row["lost"] = max(0, row["declared"] - row["submitted"])
            total["models"][model] = row
            for k in ("submitted", "completed", "failed", "pending", "declared", "lost"):
                total[k] += row[k]
        total["done"] = bool(models) and total["pending"] == 0
        return total

    def results(self, job: str, *, follow: bool = False, block_ms: int = 1000, count: int = 1000,
                should_stop: Callable[[], bool] | None = None,
                on_rewind: Callable[[Rewind], None] | None = None) -> Iterator[bytes]:
        """Result records (JSON bytes) of ``job``, from any process at any time.

        With ``follow`` it keeps reading until every submitted item has a result (or
        ``should_stop`` says so).

        A stream that lost the entry at this reader's position without deleting it was rewound:
        a failover promoted a replica that lacked results the old primary had acknowledged (and
        this reader had read). Workers then produce those results again. ``on_rewind`` is told (a Rewind),
        and results of items this reader already returned since the rewind point are skipped:
        every id once, as far as the last REWIND_WINDOW results read per stream reach.
        """
        from conductor.results_store import ResultSegments
        cursors: dict[str, str] = {}
        recent: dict[str, deque[tuple[str, str]]] = {}  # stream -> (entry id, item id), newest last
        skip: dict[str, set[str]] = {}
        segs: dict[str, ResultSegments] = {}  # stream -> its results moved to the store (disk tier)
        while True:
            models = self.job_models(job)
            for m in models:
                key = K.ModelKeys(m).job_results(job)
                cursors.setdefault(key, "0-0")
                if key not in segs:
                    segs[key] = ResultSegments(self.r, self.tier.store if self.tier else None,
                                               K.ModelKeys(m).job_rsegs(job))
            # Asked before the read: complete.lua writes a result and counts it in one step, so
            # when the job was done before a read that finds nothing, nothing is left to read.
            # Asked after, a batch completed between the two would be missed.
            done = follow and bool(models) and self.status(job, models)["done"]
            got = 0
            if cursors:
                if isinstance(self.r, redis.RedisCluster) and len(cursors) > 1:
                    # A job's models live in different slots: one read per stream, none blocking.
                    reply = [row for key, cur in list(cursors.items())
                             for row in _stream_reply(self.r.xread({key: cur}, count=count))]
                    if not reply and follow:
                        time.sleep(min(block_ms, 200) / 1000)
                else:
                    reply = _stream_reply(self.r.xread(cursors, count=count, block=block_ms if follow else None))
                # Each read is checked against the reader's position, before anything it brought
                # is returned: a reconnect to a promoted replica answers an XREAD with the results
                # done again at once.
                rewound = False
                for stream in {st for st, _e in reply} | (set() if reply else set(cursors)):
                    rw = self._rewound(stream, cursors[stream], recent.get(stream))
                    if rw is not None:
                        rewound = True
                        cursors[stream] = rw.now_at
                        skip.setdefault(stream, set()).update(rw.ids)
                        if on_rewind is not None:
                            on_rewind(rw)
                if rewound:
                    continue  # read again from the rewind point: the results after it are new
                # Results that left the stream for store segments before it was read come first,
                # in stream order (conductor/results_store.py): every record once, from either.
                read = dict(reply)
                reply = [(st, segs[st].between(cursors[st], _s(read[st][0][0]) if read.get(st) else None)
                          + list(read.get(st, []))) for st in cursors]
                for stream, entries in reply:
                    seen = recent.setdefault(stream, deque(maxlen=REWIND_WINDOW))
                    for eid, fields in entries:
                        cursors[stream] = _s(eid)
                        iid = _s(fields.get(b"id", b""))
                        if skip.get(stream) and iid in skip[stream]:
                            skip[stream].discard(iid)
                            continue
                        seen.append((_s(eid), iid))
                        got += 1
                        yield fields[b"r"]
            if got:
                continue
            if not follow or done or (should_stop and should_stop()):
                return
            if not cursors:
                time.sleep(block_ms / 1000)

    def _rewound(self, stream: str, cursor: str, recent: deque[tuple[str, str]] | None) -> Rewind | None:
        """A Rewind when the entry at ``cursor`` (the last one this reader read) is gone without
        having been deleted (see ``results``), else None. Retention's XTRIM and a purge's XDEL
        raise the stream's max-deleted-entry-id past it; a promoted replica never had it."""
        if cursor == "0-0":
            return None
        pipe = self.r.pipeline(transaction=False)
        pipe.xrange(stream, cursor, cursor, count=1)
        pipe.xinfo_stream(stream)
        pipe.xrevrange(stream, "(" + cursor, "-", count=1)
        at, info, before = pipe.execute(raise_on_error=False)
        if isinstance(at, list) and at:
            return None
        if isinstance(info, dict) and _id_key(_s(info.get("max-deleted-entry-id", "0-0"))) >= _id_key(cursor):
            return None
        kept = _s(before[0][0]) if isinstance(before, list) and before else "0-0"
        ids = [iid for eid, iid in (recent or ()) if _id_key(eid) > _id_key(kept)]
        covered = bool(recent) and _id_key(recent[0][0]) <= _id_key(kept)
        return Rewind(stream=stream, read_up_to=cursor, now_at=kept, ids=ids, all_known=covered)

    def read_results(self, job: str) -> list[Result]:
        from conductor.records import result_decoder
        return [result_decoder.decode(r) for r in self.results(job)]


# Results remembered per stream to skip their second copies after a rewind (a failover loses
# what replication had not carried yet: seconds of results, far below this).
REWIND_WINDOW = 100_000


@dataclass
class Rewind:
    """A results stream found shorter than a reader had read it (``Conductor.results``)."""

    stream: str
    read_up_to: str  # the last entry id this reader had read
    now_at: str  # the newest entry the stream still holds below it ("0-0": none)
    ids: list[str]  # item ids read past now_at: their results will come again, and are skipped
    all_known: bool  # False: the reader read more past now_at than it remembers (REWIND_WINDOW)


def _id_key(eid: str) -> tuple[int, int]:
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)


def _stream_reply(reply: Any) -> list[tuple[str, list]]:
    """XREAD replies are a list under RESP2 and a dict under RESP3."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [(_s(k), v[0] if v and isinstance(v[0], list) and len(v) == 1 and isinstance(v[0][0], list)
                 else v) for k, v in reply.items()]
    return [(_s(k), v) for k, v in reply]


def _grouped_by_shape(its: list[PreparedItem]) -> list[PreparedItem]:
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


def _submit_args(job: str, chunk: Sequence[PreparedItem]) -> list[Any]:
    """submit.lua's ARGV: the count, the job, then per item its signature, its record as workers
    will read it (keys.py) and its shape's prefix, which travels once per call."""
    args: list[Any] = [len(chunk), job]
    head = _record_head(job)
    seen: set[str] = set()
    for it in chunk:
        if it.sig in seen:
            prefix = b""
        else:
            seen.add(it.sig)
            prefix = json_encoder.encode(list(it.prefix))
        # body is the JSON [prompt, payload]: its tail after '[' ends the record
        rec = b"[" + json_encoder.encode(it.id) + head % (it.input_tokens, it.max_tokens) + it.body[1:]
        args += [it.sig, rec, prefix]
    return args


def _record_head(job: str) -> bytes:
    """The part of an item record after its id, up to its body (the tokens are %d holes)."""
    return b"," + json_encoder.encode(job) + b",%d,%d,"


def content_sum(head: bytes, it: PreparedItem) -> str:
    """What submit.lua keeps per id to tell a re-sent item from another item under the same id."""
    rec = b"[" + json_encoder.encode(it.id) + head % (it.input_tokens, it.max_tokens) + it.body[1:]
    return hashlib.sha1(it.sig.encode() + rec).hexdigest()[:16]


def _count_submit_reply(reply: list[int], report: SubmitReport) -> None:
    for lane in reply:
        if lane == -1:
            report.duplicates += 1
        else:
            report.accepted += 1


# Replies that say the command did not run, so sending it again is safe: a cluster node
# restarting or failing over, or the key's slot served elsewhere (resharding); and NOSCRIPT.
_CLUSTER_REFUSALS = (redis.exceptions.ClusterDownError, redis.exceptions.MovedError, redis.exceptions.AskError,
                     redis.exceptions.TryAgainError)
_REFUSED_BEFORE_RUNNING = (redis.exceptions.NoScriptError, *_CLUSTER_REFUSALS)


def _read_submit_reply(conn: Any, chunk: Sequence[PreparedItem], report: SubmitReport,
                       again: list[Sequence[PreparedItem]]) -> Exception | None:
    try:
        reply = conn.read_response()
    except redis.ResponseError as e:
        if isinstance(e, _REFUSED_BEFORE_RUNNING):
            again.append(chunk)  # refused before it ran: sent again through the routing client
            return None
        return e
    _count_submit_reply(reply, report)
    return None


def _check_name(kind: str, value: str) -> None:
    try:
        K.check_name(kind, value)
    except ValueError as e:
        raise BadInput(kind, str(e).split(": ", 1)[1]) from None


def _raise_script_error(e: Exception) -> NoReturn:
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
