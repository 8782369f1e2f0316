"""A model's shards as the client sees them (issue 36; conductor/redis_contract/shards.py): the
layout read from Redis (the current count in M:cfg ``shards``, the earlier ones in M:shards_old),
each shape's shard (recorded in M:shard_of at its first submit: the least loaded shard then, so
that a few shapes still spread evenly; stable afterwards), and a change of the count.

With ``shards`` unset or 1 (the default) every name here is the model's own, and nothing is read
beyond one cached HGET: the layout is today's."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

from conductor.client.core import ConductorCore
from conductor.redis_contract import keys as K
from conductor.redis_contract import shards as S
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import PreparedItem

# A producer sees a change of the count this late at most: items routed meanwhile under the old
# count wait on the old shards, which keep draining (M:shards_old).
LAYOUT_TTL_S = 2.0
# A worker, this late: new shards wait that long for it at most, and an idle worker of an unsharded
# model reads the layout (two commands) once per period, not every 2 s.
WORKER_LAYOUT_TTL_S = 5.0
# Fields of a model's cfg that stay the shard's own: its count (a shard is not sharded) and the
# reference budget its first worker sets (register.lua).
_OWN_FIELDS = ("shards", "budget_tokens", "budget_items")


class Layout(msgspec.Struct, frozen=True):
    count: int
    old: tuple[int, ...]

    def names(self, model: str) -> list[str]:
        """Every shard that may hold work: the current ones first, then the old layouts' not among them."""
        out = S.shard_names(model, self.count)
        for n in self.old:
            out += [x for x in S.shard_names(model, n) if x not in out]
        return out


class Sharding(ConductorCore):
    _layouts: dict[str, tuple[float, Layout]]
    _placed: dict[tuple[str, int], dict[str, int]]

    def layout(self, model: str, *, fresh: bool = False, max_age_s: float = LAYOUT_TTL_S) -> Layout:
        if not hasattr(self, "_layouts"):
            self._layouts, self._placed = {}, {}
        now = time.monotonic()
        got = self._layouts.get(model)
        if got is not None and not fresh and now - got[0] < max_age_s:
            return got[1]
        mk = K.ModelKeys(model)
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(mk.cfg, "shards")
        pipe.hkeys(mk.shards_old)
        raw, old = pipe.execute()
        try:
            count = S.check_count(as_str(raw)) if raw is not None else 1
        except ValueError:
            count = 1
        lay = Layout(count, tuple(sorted(int(as_str(x)) for x in old if int(as_str(x)) != count)))
        if got is not None and got[1].count != count:
            self._placed.pop((model, count), None)  # M:shard_of was emptied by the change
        self._layouts[model] = (now, lay)
        return lay

    def shards(self, model: str, max_age_s: float = LAYOUT_TTL_S) -> list[str]:
        """Every shard of ``model`` that may hold work (the model itself when it is not sharded)."""
        return self.layout(model, max_age_s=max_age_s).names(model)

    def route(self, by_model: dict[str, list[PreparedItem]]) -> dict[str, list[PreparedItem]]:
        """Items per model -> items per shard, each item under its shard's name."""
        out: dict[str, list[PreparedItem]] = {}
        for model, its in by_model.items():
            count = self.layout(model).count
            if count <= 1 or S.is_shard(model):
                out.setdefault(model, []).extend(its)
                continue
            place = self._placement(model, count, its)
            names = S.shard_names(model, count)
            for it in its:
                name = names[place[it.sig]]
                out.setdefault(name, []).append(msgspec.structs.replace(it, model=name))
        return out

    def route_cached(self, model: str, it: PreparedItem) -> tuple[str, PreparedItem] | None:
        """route() of one item when it needs no Redis read (the layout read within LAYOUT_TTL_S, the
        shape's shard known): (name, item under that name); None when route() would read Redis."""
        got = getattr(self, "_layouts", {}).get(model)
        if got is None or time.monotonic() - got[0] >= LAYOUT_TTL_S:
            return None
        count = got[1].count
        if count <= 1 or S.is_shard(model):
            return model, it
        s = self._placed.get((model, count), {}).get(it.sig)
        if s is None:
            return None
        name = S.shard_names(model, count)[s]
        return name, msgspec.structs.replace(it, model=name)

    def _placement(self, model: str, count: int, its: Iterable[PreparedItem]) -> dict[str, int]:
        """Each shape's shard: recorded, else the least loaded (waiting tokens of the shard plus
        what this call places there), largest new shapes first; recorded with HSETNX, so racing
        producers agree on the first one's choice."""
        placed = self._placed.setdefault((model, count), {})
        new: dict[str, int] = {}
        for it in its:
            if it.sig not in placed:
                new[it.sig] = new.get(it.sig, 0) + it.input_tokens + it.max_tokens
        if not new:
            return placed
        mk = K.ModelKeys(model)
        sigs = list(new)
        known = self.r.hmget(mk.shard_of, sigs)
        for sig, raw in zip(sigs, known, strict=True):
            if raw is not None and int(as_str(raw)) < count:
                placed[sig] = int(as_str(raw))
                del new[sig]
        if not new:
            return placed
        names = S.shard_names(model, count)
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.hget(K.ModelKeys(name).intake, "tokens")
        load = [int(as_str(x) or 0) if x is not None else 0 for x in pipe.execute()]
        chosen: dict[str, int] = {}
        for sig in sorted(new, key=lambda s: (-new[s], s)):
            first = S.shard_index(sig, count)  # ties go round from the hash's shard
            s = min(range(count), key=lambda i: (load[i], (i - first) % count))
            chosen[sig] = s
            load[s] += new[sig]
        pipe = self.r.pipeline(transaction=False)
        for sig, s in chosen.items():
            pipe.hsetnx(mk.shard_of, sig, s)
        pipe.execute()
        for sig, raw in zip(chosen, self.r.hmget(mk.shard_of, list(chosen)), strict=True):
            placed[sig] = int(as_str(raw)) if raw is not None else chosen[sig]
        return placed

    def ring_model_bell(self, models: Iterable[str]) -> None:
        """An idle worker of a sharded model waits on the model's own doorbell (one BLPOP: a cluster
        refuses one over keys of several slots): a submit or a seal on a shard rings it too
        (submit.lua and seal.lua rang the shard's own)."""
        pipe: Any = None
        for model in dict.fromkeys(S.fold(name) for name in models if S.is_shard(name)):
            pipe = pipe or self.r.pipeline(transaction=False)
            pipe.lpush(K.ModelKeys(model).doorbell, 1)
            pipe.ltrim(K.ModelKeys(model).doorbell, 0, 15)
        if pipe is not None:
            pipe.execute()

    def pause(self, model: str) -> None:
        """The model and each of its shards (core.pause)."""
        for name in dict.fromkeys([model, *self.shards(model, max_age_s=0)]):
            super().pause(name)

    def resume(self, model: str) -> None:
        for name in dict.fromkeys([model, *self.shards(model, max_age_s=0)]):
            super().resume(name)

    def set_config(self, model: str, values: dict[str, Any]) -> None:
        """As the core's, ``shards`` changing the layout (set_shards) and every other value copied to
        the model's shards."""
        rest = {k: v for k, v in values.items() if k != "shards"}
        super().set_config(model, rest)
        if "shards" in values:
            self.set_shards(model, S.check_count(values["shards"]))
        elif rest and len(self.layout(model, fresh=True).names(model)) > 1:
            for name in self.ensure_shards(model):
                if name != model and "mode" in rest:
                    self.reindex(name)

    def set_shards(self, model: str, count: int) -> None:
        """Change the model's count: the old layout's shards drain and are migrated (M:shards_old), new shapes
        go to the new shards. Each shard is made a model with a copy of the model's cfg."""
        mk = self.ensure_model(model)
        was = self.layout(model, fresh=True).count
        if was != count:
            pipe = self.r.pipeline(transaction=False)
            if self.ever_used(S.shard_names(model, was)):  # a model made sharded has nothing to drain
                pipe.hset(mk.shards_old, str(was), int(time.time() * 1000))
            pipe.hdel(mk.shards_old, str(count))
            pipe.delete(mk.shard_of)  # placements were under the old count
            pipe.hset(mk.cfg, "shards", count)
            pipe.execute()
        self._layouts.pop(model, None)
        self.ensure_shards(model)

    def ever_used(self, names: list[str]) -> bool:
        """Whether any of these shards ever took an item (M:intake ``submitted``)."""
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            pipe.hget(K.ModelKeys(name).intake, "submitted")
        return any(int(as_str(x) or 0) > 0 for x in pipe.execute() if x is not None)

    def drained(self, names: list[str]) -> bool:
        """Whether these shards hold nothing: no waiting item, none in flight, taken back or being moved,
        no store segment (an old layout's shards, once drained, are forgotten: shard_maintenance.py)."""
        pipe = self.r.pipeline(transaction=False)
        for name in names:
            mk = K.ModelKeys(name)
            pipe.hget(mk.intake, "items")
            pipe.hmget(mk.state, "inflight_batches", "reclaimed_items")
            pipe.zcard(mk.segs)
            pipe.hlen(mk.moving)
        got = pipe.execute()
        for i in range(len(names)):
            items, (batches, back), segs, moving = got[4 * i], got[4 * i + 1], got[4 * i + 2], got[4 * i + 3]
            if int(as_str(items) or 0) > 0 if items is not None else False:
                return False
            if int(as_str(batches) or 0) > 0 if batches is not None else False:
                return False
            if (int(as_str(back) or 0) > 0 if back is not None else False) or int(segs) > 0 or int(moving) > 0:
                return False
        return True

    def forget_drained(self, model: str, quiet_ms: int = 30_000) -> list[int]:
        """The old counts whose shards are drained and that stopped being current over ``quiet_ms``
        ago (a producer's cached layout lapsed long before: nothing new goes there), taken out of
        M:shards_old; returns them."""
        mk = K.ModelKeys(model)
        now = int(time.time() * 1000)
        gone = []
        for raw, since in self.r.hgetall(mk.shards_old).items():
            n = int(as_str(raw))
            if now - int(as_str(since)) >= quiet_ms and self.drained(S.shard_names(model, n)):
                gone.append(n)
        if gone:
            self.r.hdel(mk.shards_old, *[str(n) for n in gone])
            self._layouts.pop(model, None)
        return gone

    def ensure_shards(self, model: str) -> list[str]:
        """Every current shard made a model (cfg, group, the models registry) with the model's cfg."""
        names = self.layout(model, fresh=True).names(model)
        cfg = {as_str(k): as_str(v) for k, v in self.r.hgetall(K.ModelKeys(model).cfg).items()
               if as_str(k) not in _OWN_FIELDS}
        for name in names:
            if name == model:
                continue
            self.ensure_model(name)
            if cfg:
                self.r.hset(K.ModelKeys(name).cfg, mapping=cfg)  # type: ignore[arg-type]  # str values
        return names
