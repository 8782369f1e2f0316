"""Read-only views of a model's queues for ``conductor inspect`` and the metrics collector.

Reads are bounded: the shapes listed are the staged ones plus the active one (ZSETs), lanes
come from each instance's lane ZSET (at most lane_max of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis

from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str

if TYPE_CHECKING:
    from conductor.client import Conductor


def _hash(r: redis.Redis, key: str) -> dict[str, str]:
    return {as_str(k): as_str(v) for k, v in r.hgetall(key).items()}


def instance_row(c: Conductor, mk: K.ModelKeys, inst: str, lanes: bool = False) -> dict[str, Any]:
    h = _hash(c.r, mk.inst(inst))
    sig, _, ep = inst.partition(":")
    row: dict[str, Any] = {
        "instance": inst, "shape": sig, "epoch": int(ep), "state": h.get("state", "?"),
        "tokens": int(h.get("tokens", 0)), "items": int(h.get("items", 0)),
        "batches": int(h.get("batches", 0)), "lanes": c.r.zcard(mk.inst_lanes(inst)),
        "ready_lanes": c.r.zcard(mk.inst_ready(inst)),
    }
    if lanes:
        rows = []
        reps: Any = c.r.zrange(mk.inst_lanes(inst), 0, -1, withscores=True)  # [(member, score)]
        for lane, rep in reps:
            meta = _hash(c.r, mk.lanemeta(inst, as_str(lane)))
            rows.append({"lane": int(as_str(lane)), "rep": int(rep), "items": int(meta.get("items", 0)),
                         "tokens": int(meta.get("tokens", 0)), "since_ms": int(meta.get("since_ms", 0) or 0),
                         "last_ms": int(meta.get("last_ms", 0) or 0)})
        row["lane_rows"] = rows
    return row


def model_overview(c: Conductor, model: str, lanes: bool = False) -> dict[str, Any]:
    mk = K.ModelKeys(model)
    # One view of both halves: the fleet's state and the producer's intake counters (keys.py).
    state = {**_hash(c.r, mk.state), **_hash(c.r, mk.intake)}
    insts = [as_str(i) for i in c.r.zrevrange(mk.staged, 0, -1)]
    active = [as_str(i) for i in c.r.zrange(mk.active, 0, -1)]
    for inst in reversed(active):
        if inst not in insts:
            insts.insert(0, inst)
    shapes = [instance_row(c, mk, i, lanes) for i in insts]
    for s in shapes:
        s["warming"] = s["instance"] == state.get("warming")
    return {
        "model": model,
        "state": state,
        "config": c.config(model),
        "shapes": shapes,
        "active": active,
        "affinity": {as_str(k): as_str(v) for k, v in c.r.hgetall(mk.affinity).items()},
        "reclaimed_batches": c.r.llen(mk.reclaimed),
        "dead_letter": c.r.xlen(mk.dead) if c.r.exists(mk.dead) else 0,
        "consumers": c.consumers(model),
    }


def render(ov: dict[str, Any]) -> str:
    st = ov["state"]
    paused = " (PAUSED: conductor resume)" if st.get("paused") == "1" else ""
    out = [f"model {ov['model']}{paused}: waiting {st.get('items', 0)} items / {st.get('tokens', 0)} tokens, "
           f"in flight {st.get('inflight_items', 0)} items in {st.get('inflight_batches', 0)} batches, "
           f"gate {'open' if st.get('gate') == '1' else 'closed'}, "
           f"cleanup {'on' if st.get('cleanup') == '1' else 'off'}, active {', '.join(ov['active']) or '-'}, "
           f"warming {st.get('warming') or '-'}",
           f"  reclaimed batches {ov['reclaimed_batches']}, dead letter {ov['dead_letter']}, "
           f"completed {st.get('completed', 0)}, failed {st.get('failed', 0)}, activations {st.get('activations', 0)}"]
    if int(st.get("stored_items", 0) or 0):  # the disk tier (conductor/tier/spill.py)
        out.append(f"  in store segments {st.get('stored_items')} items / {st.get('stored_tokens', 0)} tokens")
    out.append(f"  {'shape:epoch':<22} {'state':<9} {'tokens':>10} {'items':>8} {'lanes':>6} {'ready':>6} "
               f"{'batches':>8}")
    for s in ov["shapes"]:
        out.append(f"  {s['instance']:<22} {s['state'] + ('*' if s['warming'] else ''):<9} {s['tokens']:>10} "
                   f"{s['items']:>8} {s['lanes']:>6} {s['ready_lanes']:>6} {s['batches']:>8}")
        for ln in s.get("lane_rows", []):
            out.append(f"      lane {ln['lane']:>5} rep {ln['rep']:>6} items {ln['items']:>6} tokens {ln['tokens']:>9}")
    out.append(f"  {'consumer':<30} {'pending':>8} {'idle ms':>10} alive  serves")
    for row in ov["consumers"]:
        out.append(f"  {row['name']:<30} {row.get('pending', 0):>8} {row.get('idle', 0):>10} {row['alive']!s:<5}  "
                   f"{ov['affinity'].get(row['name'], '-')}")
    return "\n".join(out)
