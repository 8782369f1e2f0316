"""The item ledger (``verify(items=True)``): where every item id is, and what is wrong with that."""

from __future__ import annotations

from typing import Any

import msgspec

from conductor.redis_contract.connection import as_str
from conductor.redis_contract.packed_ids import packed_sums
from conductor.verify.snapshot import EXAMPLES


class Rec(msgspec.Struct, array_like=True):
    """The head of an item record ``[id, job, input_tokens, max_tokens, prompt, payload]``: all
    that verify needs (msgspec skips the trailing elements)."""

    id: str
    job: str
    input_tokens: int


_rec_decoder = msgspec.json.Decoder(Rec)


def decode_rec(raw: Any) -> Rec | None:
    """One item record, or None when it does not decode (reported, never guessed at)."""
    try:
        return _rec_decoder.decode(raw)
    except (msgspec.DecodeError, TypeError):
        return None


class Ledger:
    """Where every item id is: (job, id) -> places. Only kept with items=True."""

    def __init__(self) -> None:
        self.places: dict[tuple[str, str], list[str]] = {}
        self.state: dict[tuple[str, str], str] = {}
        # job -> (redis, model keys, count) of a job with answered ids in their packed form
        # (conductor/redis_contract/packed_ids.py): named in no registry, found by asking
        self.packed: dict[str, tuple[Any, Any, int]] = {}

    def add(self, job: Any, iid: Any, place: str) -> None:
        self.places.setdefault((as_str(job), as_str(iid)), []).append(place)

    def counts(self) -> dict[str, int]:
        n_packed = sum(n for _r, _mk, n in self.packed.values())
        out = {"submitted": len(self.state) + n_packed, "done": n_packed, "waiting": 0, "inflight": 0, "reclaimed": 0,
               "orphaned": 0, "stored": 0}
        kinds = {"lane": "waiting", "batch": "inflight", "orphan": "orphaned", "store": "stored"}
        for key, st in self.state.items():
            if st != "q":
                out["done"] += 1
                continue
            for p in self.places.get(key, []):
                out[kinds.get(p.split(" ", 1)[0], "reclaimed")] += 1
        return out

    def done_lanes(self) -> set[str]:
        """Lanes ("S:E:L") holding items that have a result (lua/repair_items_done.lua clears them)."""
        return {p.split(" ", 1)[1] for key, st in self.state.items() if st != "q"
                for p in self.places.get(key, []) if p.startswith("lane ")}

    def problems(self, model: str) -> list[str]:
        """One finding per kind of misplaced item, quoting the first EXAMPLES of them."""
        found = self._misplaced()
        texts = {
            "lost": "queued item(s) are in no lane, pending batch or reclaimed batch (lost)",
            "orphaned": "queued item(s) wait in a batch list that no pending batch names (orphaned; --repair puts "
                        "them back)",
            "dup": "queued item(s) are in more than one place (duplicated)",
            "done_waiting": "item(s) with a result still wait in a lane or an orphaned batch list (--repair clears "
                            "them)",
            "phantom": "item(s) wait that no job submitted",
        }
        return [f"{model}: {len(found[kind])} {text}: {_show(found[kind])}" for kind, text in texts.items()
                if found[kind]]

    def _misplaced(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"lost": [], "orphaned": [], "dup": [], "done_waiting": [], "phantom": []}
        for key, st in self.state.items():
            places = self.places.get(key, [])
            if st == "q":
                if not places:
                    out["lost"].append(key)
                elif len(places) > 1:
                    out["dup"].append((key, places))
                elif places[0].startswith("orphan "):
                    out["orphaned"].append((key, places[0].split(" ", 1)[1]))
            elif any(p.startswith(("lane ", "orphan ")) for p in places):
                out["done_waiting"].append((key, places))
        unknown = [(key, places) for key, places in self.places.items() if key not in self.state]
        answered = self._packed([key for key, _p in unknown])
        out["phantom"] = [(key, places) for key, places in unknown if key not in answered]
        out["done_waiting"] += [(key, places) for key, places in unknown if key in answered
                                and any(p.startswith(("lane ", "orphan ")) for p in places)]
        return out

    def _packed(self, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of ``keys`` (job, id) are answered ids in their job's packed form."""
        found: set[tuple[str, str]] = set()
        for job, (r, mk, _n) in self.packed.items():
            ids = [iid for j, iid in keys if j == job]
            found |= {(job, iid) for iid, p in zip(ids, packed_sums(r, mk, job, ids), strict=True) if p is not None}
        return found


def _show(xs: list[Any]) -> str:
    return ", ".join(str(x) for x in xs[:EXAMPLES]) + (" ..." if len(xs) > EXAMPLES else "")


def ledger_records(recs: Any, place: str, ledger: Ledger) -> int:
    """Puts each item record of ``recs`` in the ledger at ``place``; returns how many do not decode."""
    bad = 0
    for raw in recs:
        rec = decode_rec(raw)
        if rec is None:
            bad += 1
        else:
            ledger.add(rec.job, rec.id, place)
    return bad
