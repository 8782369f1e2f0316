"""A job's ledger: every input line of a job against its answers (``conductor verify-job``,
``inspect --verify`` for jobs in flight, the Batch API's counts and error file).

The input lines are read from where the job's input is kept, never from Redis alone: a batch's
uploaded file (``conductor serve`` keeps it, conductor/api/upload_store.py), the file a CLI submit
recorded (``input_path`` in the job's lifecycle hash), else the job's id registry in Redis (the ids
submitted; lines never submitted are then only a count, ``lost``). The answers are the job's result
records (``Conductor.results``: the streams and the result segments).

Each input line has exactly one answer: completed, failed with a reason (the error code), cancelled,
expired, or refused at validation (a line the intake refused, ``--skip-invalid``); a job in flight
also has pending lines. A job that ended early (cancelled, expired) answers the lines it never
submitted itself, with its end's code (job_state.status_of): they are in no Redis key, so they are
derived here from the input against the answers (``unsent_lines``), not stored. A line with no
answer in a terminal job, or with two, and an answer to no input line, make the ledger unclean.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from conductor.client import Conductor
from conductor.formats.file_lines import is_parquet, iter_lines
from conductor.formats.openai_output import output_line
from conductor.jobs import job_state
from conductor.redis_contract import keys as K
from conductor.redis_contract.connection import as_str
from conductor.redis_contract.packed_ids import job_segments, stored_sums

EXAMPLES = 10  # offending ids printed
ENDED_EARLY = ("cancelled", "expired")
_dec = msgspec.json.Decoder()
_MESSAGES = {"cancelled": "the batch was cancelled before this request was submitted",
             "expired": "the batch's completion window passed before this request was submitted"}


class _Head(msgspec.Struct):
    """The fields of a result record the ledger reads."""

    id: str
    error: dict[str, Any] | None = None


_head = msgspec.json.Decoder(_Head)


@dataclass
class JobLedger:
    job: str
    status: str
    source: str  # where the input lines were read
    inputs: int = 0  # input lines (refused ones included)
    kinds: Counter[str] = field(default_factory=Counter)  # completed, failed, cancelled, expired, validation, pending
    codes: Counter[str] = field(default_factory=Counter)  # the error codes of the failed answers
    derived: int = 0  # lines answered by the job's early end (never submitted)
    lost: int = 0  # lines declared and never submitted, with no input to name them (registry source)
    doubled: list[str] = field(default_factory=list)  # ids with two answers or more
    missing: list[str] = field(default_factory=list)  # ids with no answer in a terminal job
    phantom: list[str] = field(default_factory=list)  # answers to no input line

    @property
    def clean(self) -> bool:
        return not (self.doubled or self.missing or self.phantom or (self.lost and self.terminal))

    @property
    def terminal(self) -> bool:
        return self.status in job_state.TERMINAL

    def request_counts(self) -> dict[str, int]:
        """OpenAI's counts of the lines the job took (refused lines are no requests of it)."""
        total = self.inputs - self.kinds["validation"]
        return {"total": total, "completed": self.kinds["completed"],
                "failed": total - self.kinds["completed"] - self.kinds["pending"]}

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "status": self.status, "source": self.source, "inputs": self.inputs,
                "answers": dict(self.kinds), "codes": dict(self.codes), "derived": self.derived, "lost": self.lost,
                "doubled": self.doubled[:EXAMPLES], "missing": self.missing[:EXAMPLES],
                "phantom": self.phantom[:EXAMPLES], "clean": self.clean, "request_counts": self.request_counts()}

    def render(self) -> str:
        kinds = ", ".join(f"{self.kinds[k]} {k}" for k in
                          ("completed", "failed", "cancelled", "expired", "validation", "pending") if self.kinds[k])
        head = f"job {self.job} ({self.status}): {self.inputs} input lines ({self.source}): {kinds or 'none answered'}"
        if self.codes:
            head += " | failed by code: " + ", ".join(f"{k} {v}" for k, v in sorted(self.codes.items()))
        if self.derived:
            head += f" | {self.derived} never submitted, answered by the job's end"
        lines = [head]
        problems = (("answered twice or more", self.doubled), ("with no answer", self.missing),
                    ("answers to no input line", self.phantom))
        for what, ids in problems:
            if ids:
                lines.append(f"{len(ids)} line(s) {what}: {_show(ids)}")
        if self.lost and self.terminal:
            lines.append(f"{self.lost} line(s) declared and never submitted, with no input file to name them")
        if self.clean:
            lines.append("every line answered once" if self.terminal else "no line answered twice (job in flight)")
        return "\n".join(lines)


def _show(ids: list[str]) -> str:
    return ", ".join(ids[:EXAMPLES]) + (" ..." if len(ids) > EXAMPLES else "")


def input_ids(path: str, checked: bool = False) -> Iterator[str | None]:
    """The id of every non-blank input line, None for a line the intake refuses."""
    for _n, iid, _why in input_lines_of(path, checked):
        yield iid


def input_lines_of(path: str, checked: bool = False) -> Iterator[tuple[int, str | None, str]]:
    """(line number, id, why refused) of every non-blank input line: the id None and the reason
    given for a line the intake refuses. ``checked``: each line parsed as the intake parses it (a
    line with an id and a bad field, a later line repeating an id: refused, as the intake refuses
    them); else a JSON line is only decoded for its id (a batch's file, checked whole before any
    line of it was submitted)."""
    if checked or is_parquet(path):
        seen: dict[str, int] = {}
        for n, it, _raw in iter_lines(path):
            if isinstance(it, Exception):
                yield n, None, str(it)
            elif it.id in seen:
                yield n, None, f"duplicate of line {seen[it.id]}"
            else:
                seen[it.id] = n
                yield n, it.id, ""
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = _dec.decode(raw)
            except msgspec.DecodeError:
                yield n, None, f"line {n}: not JSON"
                continue
            iid = obj.get("custom_id", obj.get("id")) if isinstance(obj, dict) else None
            yield (n, iid, "") if isinstance(iid, str) and iid else (n, None, f"line {n}: no id")


def registry_ids(c: Conductor, job: str) -> Iterator[str | None]:
    """The ids the job submitted (its id registry on each model, and the id lists of its store
    segments for the ids still waiting there), for a job without a kept input."""
    for model in c.job_models(job):
        mk = K.ModelKeys(model)
        for iid, _sum in c.r.hscan_iter(mk.job_sums(job), count=1000):  # NOVALUES is 7.4's
            yield as_str(iid)
        for name in job_segments(c.r, mk, job):
            ids = [as_str(i) for i in c.r.lrange(mk.seg_ids(name), 0, -1)]
            # an id a lane took has left the stored ids for the registry: named there already
            yield from (i for i, s in zip(ids, stored_sums(c.r, mk, job, ids), strict=True) if s is not None)


def answers(records: Iterable[bytes]) -> dict[str, list[str]]:
    """Item id -> the codes of its answers ('' for a completed one), in the order written."""
    out: dict[str, list[str]] = {}
    for raw in records:
        rec = _head.decode(raw)
        code = str(rec.error.get("code", "error")) if rec.error else ""
        out.setdefault(rec.id, []).append(code)
    return out


def _kind(code: str) -> str:
    return "completed" if not code else code if code in ENDED_EARLY else "failed"


def build(c: Conductor, job: str, input_path: str | None) -> JobLedger:
    """The ledger of ``job``; ``input_path`` the kept input file (None: the id registry)."""
    status = job_state.describe(c, job, advance=False)["status"]
    got = answers(c.results(job))
    use_file = bool(input_path) and os.path.exists(str(input_path))
    led = JobLedger(job, status, f"input file {input_path}" if use_file else "the job's id registry in Redis")
    seen: set[str] = set()
    for iid in input_ids(str(input_path), checked=True) if use_file else registry_ids(c, job):
        led.inputs += 1
        if iid is None or iid in seen:  # refused by the intake (no id, or an id repeated)
            led.kinds["validation"] += 1
            continue
        seen.add(iid)
        codes = got.get(iid)
        if codes:
            _answered(led, iid, codes)
        elif status in ENDED_EARLY:
            led.kinds[status] += 1
            led.derived += 1
        elif led.terminal:
            led.missing.append(iid)
        else:
            led.kinds["pending"] += 1
    led.phantom = [iid for iid in got if iid not in seen]
    if not use_file:
        _registry_counts(c, led, got, len(seen))
    return led


def _answered(led: JobLedger, iid: str, codes: list[str]) -> None:
    if len(codes) > 1:
        led.doubled.append(iid)
    led.kinds[_kind(codes[0])] += 1
    if _kind(codes[0]) == "failed":
        led.codes[codes[0]] += 1


def _registry_counts(c: Conductor, led: JobLedger, got: dict[str, list[str]], held: int) -> None:
    """What the registry cannot name: ids compacted out of it, lines declared and never sent."""
    st = c.status(led.job)
    if led.phantom and held < st["submitted"]:
        # The registry holds fewer ids than were submitted (answered ids compacted out of it to
        # bound memory): an answer to an id it no longer holds is that id's, not a phantom's.
        gone = st["submitted"] - held
        for iid in led.phantom[:gone]:
            led.inputs += 1
            _answered(led, iid, got[iid])
        led.phantom = led.phantom[gone:]
    led.lost = 0 if led.status in ENDED_EARLY else st["lost"]
    if led.status in ENDED_EARLY and st["lost"]:
        led.derived += st["lost"]  # lines the end answered, known only by their count
        led.kinds[led.status] += st["lost"]
        led.inputs += st["lost"]


def kept_input(c: Conductor, job: str) -> str | None:
    """The path of the input a CLI submit recorded for ``job`` (``input_path``), if any."""
    return as_str(c.r.hget(K.job_meta_key(job), "input_path"), absent="") or None


def input_lines(c: Conductor, job: str, input_path: str) -> int:
    """How many lines the job's input holds, counted once and kept in its lifecycle hash."""
    key = K.job_meta_key(job)
    kept = c.r.hget(key, "input_lines")
    if kept is not None:
        return int(kept)
    n = sum(1 for _ in input_ids(input_path)) if os.path.exists(input_path) else 0
    c.r.hsetnx(key, "input_lines", n)
    return n


def ended_counts(c: Conductor, job: str, rc: dict[str, int], input_path: str | None) -> dict[str, int]:
    """The request counts of a job that ended early: every input line, those never submitted failed
    with the end's code. (Each submitted line has one answer: completed + failed = submitted.)"""
    kept = c.r.hget(K.job_meta_key(job), "input_lines")
    if not input_path and kept is None:
        return rc
    total = max(int(kept) if kept is not None else input_lines(c, job, str(input_path)), rc["total"])
    return {"total": total, "completed": rc["completed"], "failed": total - rc["completed"]}


def unsent_lines(c: Conductor, job: str, answered: set[str], input_path: str | None,
                 status: str | None = None, checked: bool = False) -> Iterator[dict[str, Any]]:
    """The error lines (OpenAI's format) of the input lines a job that ended early never submitted:
    each with the end's code (``cancelled``, ``expired``) and the same ids every time it is read.
    ``checked``: lines the intake refuses are left out (``input_lines_of``; a batch has none)."""
    if status is None:
        status = job_state.describe(c, job, advance=False)["status"]
    if status not in ENDED_EARLY or not input_path or not os.path.exists(input_path):
        return
    seen: set[str] = set()
    for iid in input_ids(input_path, checked):
        if iid is None or iid in answered or iid in seen:
            continue
        seen.add(iid)
        line, _failed = output_line({"id": iid, "job": job, "payload": {"custom_id": iid},
                                     "error": {"code": status, "message": _MESSAGES[status]}})
        yield line


def derived_lines(c: Conductor, job: str, input_path: str, answered: set[str]) -> Iterator[dict[str, Any]]:
    """The error lines (OpenAI's format) no result record holds, for a job that has ended, from its
    kept input: each line the intake refused (code ``validation``, with the reason and line) and,
    for a job that ended early, each line never submitted (``unsent_lines``)."""
    status = job_state.describe(c, job, advance=False)["status"]
    if status not in job_state.TERMINAL or not os.path.exists(input_path):
        return
    for n, iid, why in input_lines_of(input_path, checked=True):
        if iid is None:
            line, _failed = output_line({"id": f"line-{n}", "job": job, "payload": None,
                                         "error": {"code": "validation", "message": why}})
            line["custom_id"] = None
            yield line
    yield from unsent_lines(c, job, answered, input_path, status, checked=True)
