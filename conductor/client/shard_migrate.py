"""Waiting shapes moved to their new shards after a model's shard count changed (issue 36).

The old layout's shards (M:shards_old) are drained by the migration as well as by the workers: the
model's lease holder (workers/shard_maintenance.py) claims batches there under its own name, as
any worker does (claim.lua takes the items out of the lanes with every count kept), hands each
batch over (lua/hand_over.lua: out of the shard's in-flight counts, registries and submitted
counts, into M:moving:<token> of the same slot), submits its items to the model, which routes them
to their new shards (submit.lua, idempotent on id there), and then deletes the moving list. A batch
delivered before (taken from the old shard's reclaimed queue) keeps its delivery count: its items
join the new shard's reclaimed queue with it (lua/hand_in.lua, idempotent on id too), so a change of
the count never resets what the dead letter is judged on. An item
is claimable in one place at any time; a migration that dies between the steps leaves either a
batch pending under its name (a reclaim hands it back to the old shard: run there, or moved later)
or a moving list, which the next step submits again (the ids already there are skipped).

Request items (a request job, conductor/client/request.py) move like any item: their caller waits
on its reply list a slice at a time and follows the item to its shape's shard under the new count
(request.py _Core.follow), reading the list it left too. (They stayed on the old shard before, a
batch holding one given back with a delivery counted each step: at max_deliveries the migration
itself dead-lettered them.)"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from conductor.redis_contract import keys as K
from conductor.redis_contract import rules
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.records import Batch, Contract, JobClass, PreparedItem

# One claim takes this much of an old shard at most: the step stays short (a maintenance tick).
MOVE_ITEMS = 512
MOVE_TOKENS = 1 << 20


class _Record(msgspec.Struct, array_like=True):
    id: str
    job: str
    input_tokens: int
    max_tokens: int
    prompt: msgspec.Raw
    payload: msgspec.Raw


_record = msgspec.json.Decoder(_Record)


class MigrateClient(Protocol):
    r: Any
    scripts: Any

    def shards(self, model: str, max_age_s: float = ...) -> list[str]: ...

    def layout(self, model: str, *, fresh: bool = False, max_age_s: float = ...) -> Any: ...

    def claim(self, contract: Contract, consumer: str) -> tuple[Batch | None, str]: ...

    def fail(self, batch: Batch, consumer: str, reason: str) -> tuple[int, int]: ...

    def submit(self, items: Any, job: str, *, checked: bool = ...) -> Any: ...

    def set_job_class(self, job: str, models: Any, job_class: JobClass) -> None: ...

    def _confirmed(self, call: Any) -> Any: ...

    def _intake_model(self, model: str) -> K.ModelKeys: ...

    def _register_job(self, job: str, model: str) -> None: ...

    def prefix(self, model: str, sig: str) -> list[str]: ...

    def route(self, by_model: dict[str, list[PreparedItem]]) -> dict[str, list[PreparedItem]]: ...

    def ring_model_bell(self, models: Any) -> None: ...


def old_shards(c: MigrateClient, model: str) -> list[str]:
    """The shards of the old layouts that are not shards of the current one."""
    lay = c.layout(model, fresh=True)
    current = set(lay.names(model)[:lay.count]) if lay.count > 1 else {model}
    return [n for n in lay.names(model) if n not in current]


def step(c: MigrateClient, model: str, consumer: str, *, batches: int = 8) -> int:
    """One bounded step of the migration of ``model``: moving lists left by an earlier step first,
    then up to ``batches`` batches from the old shards. Returns the items moved."""
    moved = 0
    olds = old_shards(c, model)
    for shard in olds:
        moved += _resume(c, model, shard)
    for shard in olds:
        contract = Contract(model=shard, max_batch_size=MOVE_ITEMS, max_batch_tokens=MOVE_TOKENS,
                            max_input_len=rules.MAX_INPUT_TOKENS)
        for _ in range(batches):
            batch, _why = c.claim(contract, consumer)
            if batch is None:
                break
            found = _token(c, shard, batch.batch_id)
            if found is None:
                break
            token, dv = found
            if calls.hand_over(K.ModelKeys(shard), batch.batch_id, consumer, token).run(c.scripts):
                moved += _submit_moving(c, model, shard, token, batch.shape, dv)
    return moved


def _token(c: MigrateClient, shard: str, batch_id: str) -> tuple[str, int] | None:
    """The batch's token and delivery count (its entry's k and dv), or None when it is gone."""
    rows = c.r.xrange(K.ModelKeys(shard).batches, batch_id, batch_id)
    if not rows:
        return None
    k, dv = rows[0][1].get(b"k"), rows[0][1].get(b"dv")
    return (as_str(k), int(as_str(dv or b"1"))) if k is not None else None


def _resume(c: MigrateClient, model: str, shard: str) -> int:
    """Moving lists an earlier step left (it died before deleting them): their items submitted again."""
    mk = K.ModelKeys(shard)
    moved = 0
    for token, val in c.r.hgetall(mk.moving).items():
        sig, _, dv = as_str(val).partition(":")  # 'sig:dv' for a batch delivered before (hand_over.lua)
        moved += _submit_moving(c, model, shard, as_str(token), sig, int(dv or 1))
    return moved


def _submit_moving(c: MigrateClient, model: str, shard: str, token: str, sig: str, dv: int = 1) -> int:
    """One moving list's items submitted to the model (their new shard), then the list deleted.
    ``dv``: the delivery count the items' next claim gives them; above 1 (they were delivered and
    given back on the old shard) they join their new shard's reclaimed queue with it
    (lua/hand_in.lua), so that a change of S does not reset the count the dead letter is judged on."""
    mk = K.ModelKeys(shard)
    prefix = c.prefix(shard, sig)  # the shape's record stays on the old shard (M:shape:S)
    recs = c.r.lrange(mk.moving_items(token), 0, -1)
    by_job: dict[str, list[PreparedItem]] = {}
    for raw in recs:
        r = _record.decode(raw)
        body = b"[" + bytes(r.prompt) + b"," + bytes(r.payload) + b"]"
        by_job.setdefault(r.job, []).append(PreparedItem(id=r.id, model=model, sig=sig, input_tokens=r.input_tokens,
                                                         max_tokens=r.max_tokens, body=body, prefix=tuple(prefix)))
    for job, its in by_job.items():
        cls = c.r.hmget(mk.job_intake(job), "tenant", "prio", "deadline_ms")
        if cls[0] is not None or cls[1] is not None:
            c.set_job_class(job, [model], JobClass(as_str(cls[0] or b""), as_str(cls[1] or b"batch"),
                                                   int(as_str(cls[2] or b"0"))))
        if dv > 1:
            _hand_in(c, model, job, its, dv)
        else:
            c.submit(its, job, checked=True)
    pipe = c.r.pipeline(transaction=False)
    pipe.delete(mk.moving_items(token))
    pipe.hdel(mk.moving, token)
    pipe.execute()
    return len(recs)


def _hand_in(c: MigrateClient, model: str, job: str, its: list[PreparedItem], dv: int) -> None:
    """Items delivered before, to their new shard's reclaimed queue with their count (lua/hand_in.lua):
    the shard registered for the job and the model as submit registers it first."""
    routed = c.route({model: its})
    for name, part in routed.items():
        mk = c._intake_model(name)
        c._register_job(job, name)
        c._confirmed(calls.hand_in(mk, job, part, dv))  # on the replicas as a submit is
    c.ring_model_bell(routed)
