"""Hypothesis stateful test: random interleavings of every state change against a real Redis,
with every counter checked against the truth after every step (conductor/verify/).

The machine drives submit (several shapes, lengths and jobs, resubmitted ids), a file's durable
intake killed after a few chunks and resumed by another process (issue 25), claim (several
contracts and consumers), complete (partial, final, twice, and late after a reclaim), fail,
worker death (heartbeat gone, then reclaim), lease loss (an idle sweep of live consumers), a
dead-letter retry, cancel, a retry of a cancelled job from its kept input (conductor/intake/retry.py),
and time passing (small quiet/lane/hygiene/aging thresholds, so the lifecycle moves: cleanup,
draining, finishing, lane retirement, pre-warm, aging preemption). After each step:

- ``verify`` finds no counter that differs from the data it counts, and its item ledger finds
  no queued item lost or in two places, no done item waiting, nothing waiting unsubmitted;
- submitted = waiting + in flight + reclaimed + done, item by item;
- the job items hashes hold exactly the ids the machine submitted.

At the end everything is drained: every job completes and the counters are still exact, and each
retried job's lines are answered once over it and its retry.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from conductor.client import Conductor, connect
from conductor.errors import ConductorError
from conductor.intake import retry
from conductor.jobs import job_state
from conductor.redis_contract import keys as K
from conductor.redis_contract import script_calls as calls
from conductor.redis_contract.records import Batch, Contract, PreparedItem
from conductor.verify import verify
from tests.conftest import item
from tests.helpers import results_for

MODEL = "acct"
MK = K.ModelKeys(MODEL)
JOBS = ("ja", "jb", "jc")
SHAPES = (("sys a",), ("sys b", "shots"), ("sys c",), ("sys d", "x", "y"))
CONSUMERS = ("c0", "c1", "c2")
CONTRACTS = (
    Contract(model=MODEL, max_batch_size=4, max_batch_tokens=512, max_input_len=4096),
    Contract(model=MODEL, max_batch_size=16, max_batch_tokens=2048, max_input_len=4096),
    Contract(model=MODEL, max_batch_size=1, max_batch_tokens=64, max_input_len=4096),
    Contract(model=MODEL, max_batch_size=64, max_batch_tokens=8192, max_input_len=4096),
)
HB_MS = 600_000
PICK = st.integers(0, 1 << 16)


def SPECS(lo: int, hi: int) -> st.SearchStrategy[list[tuple[int, int]]]:  # noqa: N802
    """(shape, input tokens) per item."""
    return st.lists(st.tuples(st.integers(0, len(SHAPES) - 1), st.integers(1, 700)), min_size=lo, max_size=hi)


def _describe(rep) -> str:  # noqa: ANN001
    rows = [f"{r.key} {r.field}: recorded {r.recorded}, truth {r.truth}" for r in rep.drift]
    return "\n".join(rows + rep.problems)


class Accounting(RuleBasedStateMachine):
    url = ""
    dir = Path(".")

    def __init__(self) -> None:
        super().__init__()
        r = connect(self.url)
        r.flushall()
        self.c = Conductor(r)
        self.r = r
        self.open: list[tuple[Batch, str]] = []  # claimed, not yet completed/failed by its worker
        self.stale: list[tuple[Batch, str]] = []  # completed, failed or reclaimed: a late worker may still write
        self.ids: dict[str, set[str]] = {j: set() for j in JOBS}
        self.sent: dict[str, PreparedItem] = {}  # id -> the item as first submitted (ids are unique across jobs)
        self.lines: dict[str, dict] = {}  # id -> its input line (native), for a retry's kept input
        self.retried: dict[str, tuple[str, set[str], set[str]]] = {}  # old job -> (new job, its ids, retried ids)
        self.cancelled: set[str] = set()  # jobs a cancel reached: an intake into one stops (its own test)
        self.seq = 0
        self.tmp = tempfile.mkdtemp(prefix="acct-intake-")  # input files of the intake rule

    # The model's shards (issue 36): the model alone here, three in ShardedAccounting below.
    def names(self) -> list[str]:
        return [MODEL]

    def _beat(self, consumer: str) -> None:
        for n in self.names():
            self.r.set(K.ModelKeys(n).heartbeat(consumer), 1, px=HB_MS)

    def _claim(self, contract: Contract, consumer: str) -> tuple[Batch | None, str]:
        return self.c.claim(contract, consumer)

    extra_config: dict = {}

    # One initialize rule: hypothesis runs several in any order, and a backlog submitted before
    # a mode change would leave fill/ready stale (test_verify_config.py covers that case).
    @initialize(mode=st.sampled_from(["memory", "disk"]), release=st.sampled_from([0, 2]),
                aging=st.sampled_from([0, 30]), deliveries=st.sampled_from([2, 5]),
                activate=st.sampled_from([1, 3]), lane_quiet=st.sampled_from([10, 60_000]),
                prewarm=st.sampled_from([2, 50]), job=st.sampled_from(JOBS), specs=SPECS(5, 40))
    def configure(self, mode: str, release: int, aging: int, deliveries: int, activate: int, lane_quiet: int,
                  prewarm: int, job: str, specs: list[tuple[int, int]]) -> None:
        self.c.set_config(MODEL, {
            "mode": mode, "budget_tokens": 512, "budget_items": 8, "release_batches": release,
            "activate_batches": activate, "drain_batches": 1, "quiet_ms": 15, "lane_quiet_ms": lane_quiet,
            "hygiene_idle_ms": 25, "hygiene_items": 4, "prewarm_batches": prewarm, "aging_ms": aging,
            "max_deliveries": deliveries, "lane_floor": 8, "lane_cap": 64, **self.extra_config})
        self.submit(job, specs, 0)

    # ------------------------------------------------------------------ rules
    @rule(job=st.sampled_from(JOBS), specs=SPECS(1, 12), dups=st.integers(0, 3))
    def submit(self, job: str, specs: list[tuple[int, int]], dups: int) -> None:
        fresh = []
        for shape, tokens in specs:
            self.seq += 1
            fresh.append(item(f"i{self.seq}", tokens, model=MODEL, prefix=SHAPES[shape]))
            self.lines[f"i{self.seq}"] = {"id": f"i{self.seq}", "model": MODEL, "prefix": list(SHAPES[shape]),
                                          "prompt": f"pi{self.seq}", "input_tokens": tokens, "max_tokens": 16}
        again = sorted(self.ids[job])[:dups]  # a producer re-running its submit
        resubmitted = [self.sent[i] for i in again]  # the same items: other content would be refused
        rep = self.c.submit(fresh + resubmitted, job)
        assert (rep.accepted, rep.duplicates) == (len(fresh), len(again))
        self.ids[job].update(it.id for it in fresh)
        self.sent.update((it.id, it) for it in fresh)

    @rule(job=st.sampled_from(JOBS), specs=SPECS(1, 14), chunks=st.integers(0, 3), recorded=st.booleans())
    def intake_killed_and_resumed(self, job: str, specs: list[tuple[int, int]], chunks: int, recorded: bool) -> None:
        """A file's durable intake (conductor/intake/intake_task.py) whose process sends ``chunks`` chunks
        (the last one's cursor written or not) and dies; another takes the lapsed lease and finishes
        from the cursor: a chunk sent again is answered as duplicates, every line is one item."""
        from conductor.intake import intake_run
        from conductor.intake import intake_task as T
        from conductor.intake.file_intake import check_file, prepare_job, send_chunk
        if job in self.cancelled:  # an intake into a cancelled job stops: tests/test_durable_intake.py
            return
        lines = []
        for shape, tokens in specs:
            self.seq += 1
            self.lines[f"i{self.seq}"] = {"id": f"i{self.seq}", "model": MODEL, "prefix": list(SHAPES[shape]),
                                          "prompt": "p", "input_tokens": tokens, "max_tokens": 4}
            lines.append(json.dumps(self.lines[f"i{self.seq}"]) + "\n")
        path = os.path.join(self.tmp, f"f{self.seq}.jsonl")
        with open(path, "w") as f:
            f.write("".join(lines))
        defaults = intake_run.Defaults(lambda: self.r, None)
        found = check_file(path, skip_invalid=False, rejects=None, default_max_tokens=defaults)
        prepare_job(self.c, found, job)
        T.create(self.c, T.Task(job=job, source="cli", path=path, state="sending", defaults={}), "first")
        key, line, sent, unrecorded = K.intake_task_key(job), 0, 0, 0
        for k, chunk in zip(range(chunks), found.chunks(4), strict=False):
            send_chunk(self.c, chunk, job)
            self.ids[job].update(it.id for _, it in chunk)
            self.sent.update((it.id, it) for _, it in chunk)
            if recorded or k < chunks - 1:
                line, sent = chunk[-1][0], sent + len(chunk)
                assert calls.intake_cursor(key, "first", T.LEASE_MS, line, sent).run(self.c.scripts)
            else:
                unrecorded = len(chunk)
        self.r.hset(key, "lease_ms", 1)  # the first process died: its lease lapsed
        assert calls.intake_lease(key, "second", T.LEASE_MS).run(self.c.scripts).held
        os.environ[T.CHUNK_ENV] = "4"
        try:
            out = intake_run.run(self.c, job, "second", found, defaults)
        finally:
            del os.environ[T.CHUNK_ENV]
        assert out.state == "done" and out.duplicates == unrecorded, out
        assert out.accepted + out.duplicates == len(specs) - sent
        for chunk in found.chunks(1000):
            self.ids[job].update(it.id for _, it in chunk)
            self.sent.update((it.id, it) for _, it in chunk)
        task = T.read(self.r, job)
        assert task is not None and (task.state, task.sent) == ("done", len(specs))

    @rule(contract=st.sampled_from(CONTRACTS), consumer=st.sampled_from(CONSUMERS), times=st.integers(1, 3))
    def claim(self, contract: Contract, consumer: str, times: int) -> None:
        self._beat(consumer)
        for _ in range(times):
            batch, _why = self._claim(contract, consumer)
            if batch is None:
                return
            assert 1 <= len(batch.items) <= contract.max_batch_size
            assert len({(i.job, i.id) for i in batch.items}) == len(batch.items)
            self.open.append((batch, consumer))

    # Claims depend on the clock (gate, quiet, aging), so which batches exist is not a function
    # of the drawn data: rules draw a plain index and apply it to what exists, never a
    # precondition or a draw that depends on Redis (hypothesis would call the test flaky).
    @rule(pick=PICK, final=st.booleans(), error=st.booleans(), part=st.floats(0, 1))
    def complete(self, pick: int, final: bool, error: bool, part: float) -> None:
        pool = self.open + self.stale
        if not pool:
            return
        batch, consumer = pool[pick % len(pool)]
        results = results_for(batch, consumer, error=error)
        if not final:
            results = results[:int(len(results) * part)]
        self.c.complete(batch, results, final=final)
        if final and (batch, consumer) in self.open:
            self.open.remove((batch, consumer))
            self.stale.append((batch, consumer))

    @rule(pick=PICK)
    def fail(self, pick: int) -> None:
        if not self.open:
            return
        batch, consumer = self.open[pick % len(self.open)]
        self.c.fail(batch, consumer, "engine exploded")
        self.open.remove((batch, consumer))
        self.stale.append((batch, consumer))

    @rule(contract=st.sampled_from(CONTRACTS), times=st.integers(1, 4))
    def poison_loop(self, contract: Contract, times: int) -> None:
        """A worker whose engine fails every batch: reclaimed work comes back until dead-lettered."""
        self._beat("c2")
        for _ in range(times):
            batch, _why = self._claim(contract, "c2")
            if batch is None:
                return
            self.c.fail(batch, "c2", "poison")
            self.stale.append((batch, "c2"))

    @rule(consumer=st.sampled_from(CONSUMERS))
    def worker_dies(self, consumer: str) -> None:
        for n in self.names():
            self.r.delete(K.ModelKeys(n).heartbeat(consumer))
            self.c.reclaim_consumer(n, consumer)
        gone = [(b, w) for b, w in self.open if w == consumer]
        for x in gone:
            self.open.remove(x)
        self.stale.extend(gone)  # the dead worker may still have been slow, not dead: it can write late

    @rule(min_idle_ms=st.sampled_from([1, 5]))
    def leases_lost(self, min_idle_ms: int) -> None:
        time.sleep(min_idle_ms / 1000)
        pending = set()
        for n in self.names():
            self.c.reclaim_dead(n, min_idle_ms=min_idle_ms)
            got = self.r.xpending_range(K.ModelKeys(n).batches, K.GROUP, "-", "+", 10_000)
            pending |= {p["message_id"].decode() for p in got}
        for x in [x for x in self.open if x[0].batch_id not in pending]:
            self.open.remove(x)
            self.stale.append(x)

    @rule(job=st.sampled_from((None, *JOBS)))
    def dead_letter_retried(self, job: str | None) -> None:
        from conductor.jobs.deadletter import DeadLetter
        for n in self.names():
            DeadLetter(self.c).retry(model=n, job=job)

    @rule(job=st.sampled_from(JOBS))
    def cancel(self, job: str) -> None:
        if self.ids[job] and job not in self.retried:
            try:
                job_state.cancel(self.c, job)
            except ConductorError as e:  # every item answered already: an ended job is not cancelled
                assert "nothing to cancel" in str(e), e
                assert job_state.describe(self.c, job)["status"] in ("completed", "cancelled", "expired"), e
                return
            self.cancelled.add(job)

    @rule(job=st.sampled_from(JOBS))
    def retry_cancelled(self, job: str) -> None:
        """A cancelled job's unanswered lines as a new job, from the input its submit kept."""
        if job in self.retried or job_state.describe(self.c, job)["status"] != "cancelled":
            return
        src = self.dir / f"{job}.jsonl"
        src.write_text("".join(json.dumps(self.lines[i]) + "\n" for i in sorted(self.ids[job])))
        p = retry.plan(self.c, job, str(src))
        new = f"{job}.r"
        if not p.ids:
            return
        assert retry.submit(self.c, job, new, str(src), p, str(self.dir / f"{new}.jsonl")) == len(p.ids)
        self.retried[job] = (new, set(self.ids[job]), set(p.ids))
        self.ids[new] = set(p.ids)

    @rule(ms=st.sampled_from([2, 12, 30]))
    def time_passes(self, ms: int) -> None:
        time.sleep(ms / 1000)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def counters_equal_the_truth(self) -> None:
        total = 0
        for name in self.names():
            rep = verify(self.r, name, items=True)
            assert rep.ok, _describe(rep)
            n = rep.ledger
            assert n["submitted"] == n["waiting"] + n["inflight"] + n["reclaimed"] + n["done"], n
            total += n["submitted"]
        assert total == sum(len(v) for v in self.ids.values())
        for job, ids in self.ids.items():
            stored = set()
            for name in self.names():
                stored |= {k.decode() for k in self.r.hkeys(K.ModelKeys(name).job_sums(job))}
            assert stored == ids, job

    def teardown(self) -> None:
        """Drain: every worker revives, stale leases are swept, and every job completes."""
        try:
            for w in CONSUMERS:
                self._beat(w)
            for b, w in self.open:
                self.c.complete(b, results_for(b, w))
            deadline = time.monotonic() + 20
            contract = CONTRACTS[3]
            while time.monotonic() < deadline:
                b, why = self._claim(contract, "drainer")
                if b is not None:
                    self.c.complete(b, results_for(b, "drainer"))
                    continue
                # A gate that never opened answers 'gate' rather than 'idle' while nothing waits.
                waiting = sum(int(self.r.hget(K.ModelKeys(n).intake, "items") or 0) for n in self.names())
                if why == "idle" or (why == "gate" and waiting == 0):
                    break
                time.sleep(0.01)
            for name in self.names():
                rep = verify(self.r, name, items=True)
                assert rep.ok, _describe(rep)
            for job, ids in self.ids.items():
                if ids:
                    s = self.c.status(job)
                    assert s["done"] and s["submitted"] == len(ids), s
            for job, (new, old_ids, again) in self.retried.items():  # each line answered once over the two
                ok = {x.id for x in self.c.read_results(job) if x.error is None}
                assert not ok & again and (ok & old_ids) | again == old_ids, job
                assert {x.id for x in self.c.read_results(new)} == again, new
        finally:
            self.r.close()
            shutil.rmtree(self.tmp, ignore_errors=True)


# The default run explores 20 programs of 30 steps; the long form 40 (pytest -m slow).
@pytest.mark.parametrize("examples", [20, pytest.param(40, marks=pytest.mark.slow)])
def test_accounting_never_drifts(redis_server, examples, tmp_path) -> None:  # noqa: ANN001
    Accounting.url = redis_server.url
    Accounting.dir = tmp_path
    run_state_machine_as_test(Accounting, settings=settings(
        max_examples=examples, stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


class ShardedAccounting(Accounting):
    """The same machine on a model of three shards (issue 36; on one Redis, where shards work
    too): claims over the shards as a worker makes them (conductor/client/shard_claims.py),
    heartbeats, reclaims and dead-letter retries on every shard, each shard verified."""

    extra_config = {"shards": 3}

    def __init__(self) -> None:
        super().__init__()
        from conductor.client.shard_claims import ShardClaims

        self.claims = ShardClaims(self.c, MODEL)

    def names(self) -> list[str]:
        return self.c.shards(MODEL)

    def _claim(self, contract: Contract, consumer: str) -> tuple[Batch | None, str]:
        return self.claims.claim(contract, consumer)

    spread: list[int] = []  # per program: the shards that took items (the test asserts they were several)

    def teardown(self) -> None:
        used = [n for n in self.names() if any(self.r.exists(K.ModelKeys(n).job_sums(j)) for j in self.ids)]
        type(self).spread.append(len(used))
        super().teardown()


# A few programs on a three-master Redis Cluster in the default run (each shard on its own master);
# more with the long form, on one Redis too.
@pytest.mark.parametrize(("where", "examples"), [("cluster", 4), pytest.param("cluster", 20, marks=pytest.mark.slow),
                                                 pytest.param("redis", 20, marks=pytest.mark.slow)])
def test_accounting_over_shards_never_drifts(redis_server, where, examples, tmp_path) -> None:  # noqa: ANN001
    from contextlib import nullcontext

    from conductor.embedded import EmbeddedCluster

    ShardedAccounting.dir = tmp_path
    ShardedAccounting.spread = []
    with EmbeddedCluster(3) if where == "cluster" else nullcontext(redis_server) as server:
        ShardedAccounting.url = server.url
        run_state_machine_as_test(ShardedAccounting, settings=settings(
            max_examples=examples, stateful_step_count=30, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert max(ShardedAccounting.spread) >= 2, ShardedAccounting.spread  # else not over shards at all


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
