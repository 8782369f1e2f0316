"""The worker's claim: claim.lua and the LRANGE of its items in one round trip on a connection of
the claim's own, and the batch of a claim whose reply was lost, found again by its token."""

from __future__ import annotations

import operator
import secrets
import time
from typing import Any

import msgspec
import redis
from hiredis import pack_command

from conductor.client.core import ConductorCore
from conductor.client.submit_stream import CLUSTER_REFUSALS
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.packing import pad8
from conductor.redis_contract.records import Batch, Contract, decode_items

_max_tokens = operator.attrgetter("max_tokens")


class Claiming(ConductorCore):
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
        for attempt in range(3):
            token = secrets.token_hex(8)
            call = calls.claim(mk, contract, consumer, token)
            reply, raw = self._round_trip(call, mk, consumer, token)
            verdict = self._verdict(reply, raw, attempt, contract.model)
            if verdict == "nogroup":
                return None, "nogroup"
            if verdict == "ran":
                break
        else:
            if isinstance(reply, CLUSTER_REFUSALS):
                raise reply  # still refused: the worker rides it out (workers/transient.py)
            # Each try was refused before the script ran (NOSCRIPT again: a failover's empty cache met
            # on each try; a token in use): nothing was written, so this is a refusal to ride out and
            # claim again later, as a cluster's is, not an error that stops the worker.
            last = f"{type(reply).__name__}: {reply}"
            raise redis.exceptions.TryAgainError(f"claim.lua: no usable reply after 3 attempts (the last: {last})")
        got = call.reply(reply)
        if isinstance(got, calls.NoBatch):
            return None, got.reason
        if len(raw) != got.n:
            # Only a reclaim between the script and the read (a lost lease) empties the list;
            # the items are then in the reclaimed queue, nothing is lost.
            return None, "raced"
        return self._batch(contract.model, got, raw), "batch"

    def _round_trip(self, call: calls.Call[Any], mk: K.ModelKeys, consumer: str, token: str) -> tuple[Any, Any]:
        """claim.lua and the LRANGE of its batch list, replies undecoded."""
        try:
            return self._send_two(call.command(self.scripts.claim.sha), ("LRANGE", mk.batch_items(token), 0, -1))
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            # The script may have run and only its reply been lost: its batch would then sit
            # in this consumer's pending list, unknown to it, until the stale sweep (minutes).
            # The token names it: the next claim looks it up first.
            lost = self._lost_claims.setdefault((mk.model, consumer), [])
            lost.append(token)
            del lost[:-16]
            raise

    def _verdict(self, reply: Any, raw: Any, attempt: int, model: str) -> str:
        """'ran' (reply and items usable), 'again' (refused before it ran: try once more) or
        'nogroup'; an error reply the claim cannot ride out raises, mapped like every script's."""
        if isinstance(reply, redis.exceptions.NoScriptError):
            # a restart, a SCRIPT FLUSH or a failover (a replica's cache starts empty) emptied the cache of
            # the node the claim went to: loaded there, through the pool _send_two used, not on whichever
            # nodes the cluster client holds for primaries while its view of a failover is behind
            redis.Redis(connection_pool=self._pool_for(K.ModelKeys(model).base)).script_load(self.scripts.claim.script)
            return "again"
        if isinstance(reply, CLUSTER_REFUSALS):
            # Refused before it ran (the LRANGE read nothing): a cluster restarting, or the
            # model's slot moved to another node (resharding), whose pool the next try uses.
            if isinstance(self.r, redis.RedisCluster) and isinstance(reply, redis.exceptions.MovedError):
                self.r.nodes_manager.initialize()
            time.sleep(0.05 * (attempt + 1))
            return "again"
        if isinstance(reply, redis.ResponseError):
            if "NOGROUP" in str(reply):
                self.ensure_model(model, force=True)
                return "nogroup"
            if "is in use by a pending batch" in str(reply):
                return "again"
            calls.raise_script_error(reply)
        if isinstance(raw, Exception):
            raise raw
        return "ran"

    def _batch(self, model: str, c: calls.Claimed, raw: list[bytes]) -> Batch:
        items = decode_items(raw)
        if c.deliveries > 1:
            for it in items:
                it.deliveries = c.deliveries
        return Batch(model=model, batch_id=c.batch_id, shape=c.sig, epoch=c.epoch, lane=c.lane,
                     padded_len=c.padded_len, max_tokens=max(map(_max_tokens, items)), claimed_at=c.claimed_at,
                     items=items, prefix=self.prefix(model, c.sig), cleanup=bool(c.flags & 1),
                     reclaimed=bool(c.flags & 2), hygiene=bool(c.flags & 4), warming=c.warming)

    def _recover_lost_claim(self, model: str, consumer: str) -> Batch | None:
        """The batch of a claim whose reply was lost, if the script ran: found by its token among
        the consumer's pending entries (a worker holds a few). A token not found there was never
        run, was lost with a Redis restart, or was reclaimed already: it is forgotten."""
        lost = self._lost_claims[(model, consumer)]
        mk = K.ModelKeys(model)
        pending = self.r.xpending_range(mk.batches, K.GROUP, min="-", max="+", count=10_000,
                                        consumername=consumer)
        pipe = self.r.pipeline(transaction=False)
        for p in pending:
            pipe.xrange(mk.batches, p["message_id"], p["message_id"])
        found: tuple[Any, dict[bytes, bytes]] | None = None
        for entry in pipe.execute():
            if entry and as_str(entry[0][1].get(b"k", b"")) in lost:
                found = entry[0]
                break
        if found is None:
            lost.clear()
            return None
        bid, f = found
        token = as_str(f[b"k"])
        lost.remove(token)
        raw: list[bytes] = self.r.lrange(mk.batch_items(token), 0, -1)  # type: ignore[assignment]  # bytes replies
        if len(raw) != int(f[b"n"]):
            return None  # reclaimed meanwhile: its items are in the reclaimed queue
        claimed = calls.Claimed(as_str(bid), as_str(f[b"sig"]), int(f[b"ep"]), int(f[b"lane"]), int(f[b"plen"]),
                                int(f[b"ts"]), int(f[b"fl"]), int(f[b"dv"]), len(raw), "")
        return self._batch(model, claimed, raw)

    def _send_two(self, first: tuple[Any, ...], second: tuple[Any, ...]) -> tuple[Any, Any]:
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
        reps: Any = self.r.zrange(mk.inst_lanes(inst), 0, -1, withscores=True)  # [(member, score)]
        return sig, int(ep), sorted({pad8(int(rep)) for _, rep in reps})

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
