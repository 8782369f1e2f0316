"""Poison items end in the dead letter after N deliveries while the rest of their job completes;
``conductor dead-letter list|retry|purge`` on a real redis-server with real worker processes."""

import json
import subprocess
import sys
import time
from collections import Counter

import pytest

from conductor.jobs.deadletter import DeadLetter
from conductor.redis_contract import keys as K
from conductor.redis_contract import schema
from conductor.redis_contract.records import Contract
from tests.conftest import ROOT, cli, item
from tests.helpers import MK, drain, quick, results_for

C = Contract(model="m", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096)


def run_poisoned_workers(url: str, cdr, job: str, poison: str, mode: str, timeout: float = 90.0) -> int:
    """Two poisoned worker processes, each restarted under a new name when it dies; returns deaths."""
    spawned = 0

    def spawn() -> subprocess.Popen:
        nonlocal spawned
        spawned += 1
        return subprocess.Popen([sys.executable, "-m", "tests.poison_worker", url, "m", f"pw{spawned}", poison,
                                 mode, "0.5"], cwd=str(ROOT), stderr=subprocess.DEVNULL)

    procs = [spawn(), spawn()]
    deaths = 0
    deadline = time.monotonic() + timeout
    try:
        while not cdr.status(job)["done"]:
            assert time.monotonic() < deadline, f"job not done: {cdr.status(job)}"
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    assert p.returncode == -9, f"worker exited {p.returncode}, not by its own SIGKILL"
                    deaths += 1
                    procs[i] = spawn()
            time.sleep(0.05)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    return deaths


def check_poisoned_job(cdr, job: str, poison: str, n: int, deliveries: int, error: str) -> None:
    dead = list(DeadLetter(cdr).items(job=job))
    assert [(d.id, d.deliveries) for d in dead] == [(poison, deliveries)]
    assert error in dead[0].error
    st = cdr.status(job)
    assert (st["completed"], st["failed"], st["pending"]) == (n - 1, 1, 0)
    rows = cdr.read_results(job)
    assert Counter(r.id for r in rows) == Counter(str(i) if str(i) != poison else poison for i in range(n))
    (bad,) = [r for r in rows if r.error]
    assert bad.id == poison and bad.error.code == "dead_letter" and bad.deliveries == deliveries
    assert cdr.r.xpending(MK.batches, K.GROUP)["pending"] == 0


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_poison_item_is_dead_lettered_and_the_rest_of_its_job_completes(cdr, redis_url, mode):
    quick(cdr, max_deliveries=3)
    cdr.submit([item(i, 20 + i % 5) for i in range(100)], "pj")
    deaths = run_poisoned_workers(redis_url, cdr, "pj", "17", mode)
    # kill: the batch holding it dies twice, then the item travels alone and dies a third time
    assert deaths == (3 if mode == "kill" else 0)
    check_poisoned_job(cdr, "pj", "17", 100, 3,
                       "died" if mode == "kill" else "RuntimeError('engine crashed on item 17')")


def test_dead_letter_cli_list_retry_without_duplicate_results(cdr, redis_url):
    quick(cdr, max_deliveries=1)
    cdr.submit([item(i, 10) for i in range(5)], "j")
    b, _ = cdr.claim(C, "dead")
    cdr.complete(b, results_for(b, "dead")[:3], final=False)
    assert cdr.reclaim_dead("m")["dead"] == 2
    rows = [json.loads(x) for x in cli("dead-letter", "list", "--job", "j", url=redis_url).stdout.splitlines()]
    assert sorted(r["id"] for r in rows) == ["3", "4"]
    assert all(r["deliveries"] == 1 and "dead died" in r["error"] and r["model"] == "m" for r in rows)
    assert cdr.status("j")["done"]
    # the dead letter that answered the job's last item stamped its end, as a completion does
    ended = cdr.r.hmget(MK.job("j"), "end", "ended_ms")
    assert ended[0] == b"completed" and int(ended[1]) > 0

    out = json.loads(cli("dead-letter", "retry", "--job", "j", url=redis_url).stdout)
    assert out == {"retried": 2, "skipped": 0}
    st = cdr.status("j")
    assert (st["completed"], st["failed"], st["pending"]) == (3, 0, 2)
    assert cdr.r.hmget(MK.job("j"), "end", "ended_ms") == [None, None]  # running again: no end
    assert sorted(r.id for r in cdr.read_results("j")) == ["0", "1", "2"]  # the dead-letter results left
    assert cdr.r.xlen(MK.dead) == 0
    again, _ = cdr.claim(C, "w")
    assert again.reclaimed and [(i.id, i.deliveries) for i in again.items] == [("3", 1)]
    cdr.complete(again, results_for(again))
    again, _ = cdr.claim(C, "w")
    cdr.complete(again, results_for(again))
    rows = cdr.read_results("j")
    assert sorted(r.id for r in rows) == ["0", "1", "2", "3", "4"] and not any(r.error for r in rows)
    st = cdr.status("j")
    assert (st["completed"], st["failed"], st["pending"]) == (5, 0, 0)
    assert cdr.r.hget(MK.job("j"), "end") == b"completed"  # stamped again by the last completion
    assert json.loads(cli("dead-letter", "retry", url=redis_url).stdout) == {"retried": 0, "skipped": 0}
    state = cdr.r.hgetall(MK.state)
    assert state[b"reclaimed_items"] == b"0" and state[b"failed"] == b"0"


def test_retry_is_atomic_per_item_and_refuses_bad_ids(cdr):
    quick(cdr, max_deliveries=1)
    cdr.submit([item(i, 10) for i in range(2)], "j")
    cdr.claim(C, "dead")
    cdr.reclaim_dead("m")
    dl = DeadLetter(cdr)
    entries = [d.entry for d in dl.items()]
    script = cdr.scripts.dead_retry
    keys = [MK.base, MK.state, MK.dead, MK.reclaimed]
    with pytest.raises(Exception, match="ERR_ARG ids"):
        script(keys=keys, args=[entries[0], "not-an-id"])
    assert cdr.r.xlen(MK.dead) == 2 and cdr.r.llen(MK.reclaimed) == 0  # nothing half-done
    assert script(keys=keys, args=[entries[0], entries[0], "1-1"]) == [1, 2]


def test_purge_by_job_keeps_results_and_other_jobs(cdr, redis_url):
    quick(cdr, max_deliveries=1)
    cdr.submit([item(i, 10) for i in range(3)], "a")
    cdr.submit([item(i, 10) for i in range(2)], "b")
    for _ in range(2):
        cdr.claim(C, "dead")
    cdr.reclaim_dead("m")
    assert cdr.r.xlen(MK.dead) == 5
    assert json.loads(cli("dead-letter", "purge", "--job", "a", "--yes", url=redis_url).stdout) == {"purged": 3}
    assert {d.job for d in DeadLetter(cdr).items()} == {"b"}
    assert cdr.status("a")["failed"] == 3 and cdr.status("a")["done"]
    assert len(cdr.read_results("a")) == 3


def test_retry_of_a_schema_1_dead_entry_rebuilds_its_item_record(cdr):
    # Dead entries written under key schema 1 hold the body ('d'), which schema 1 took with a
    # leading space or a third element too; once migrated (migrations/0004 builds the record that
    # dead_retry.lua used to build on the fly), a retry must hand the worker a readable record.
    quick(cdr, max_deliveries=1)
    cdr.submit([item(i, 10) for i in range(3)], "j")
    cdr.claim(C, "dead")
    cdr.reclaim_dead("m")
    bodies = {"0": '["p0", {"row": 0}]', "1": ' ["p1", null]', "2": '["p2", 7, "extra"]'}
    for eid, f in cdr.r.xrange(MK.dead):
        old = {k.decode(): v for k, v in f.items() if k != b"it"}
        old["d"] = bodies[old["id"].decode()]
        cdr.r.xadd(MK.dead, old)
        cdr.r.xdel(MK.dead, eid)
    cdr.r.set(K.SCHEMA_KEY, 3)
    assert schema.migrate(cdr.r) == [4, 5, 6]
    assert DeadLetter(cdr).retry(job="j")["retried"] == 3
    got = {it.id: it for b in drain(cdr, C, "w2") for it in b.items}
    assert sorted(got) == ["0", "1", "2"]
    assert all(not it.unreadable for it in got.values())
    assert (got["0"].prompt, got["0"].payload) == ("p0", {"row": 0})
    assert (got["1"].prompt, got["1"].payload) == ("p1", None)
    assert (got["2"].prompt, got["2"].payload) == ("p2", 7)
    assert all(it.input_tokens == 10 and it.job == "j" for it in got.values())


def test_a_line_retried_into_a_new_job_leaves_the_old_jobs_dead_letter(cdr, tmp_path):
    """conductor retry takes a job's dead-lettered lines into a new job and their dead letters with
    them: a later dead-letter retry cannot answer them again in the old job (found by the stateful
    accounting test: retry, then dead-letter retry, gave a line an ok answer in both jobs)."""
    from conductor.intake import retry
    quick(cdr, max_deliveries=1)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "model": "m", "prefix": ["sys"], "prompt": "p",
                                       "input_tokens": 10, "max_tokens": 4}) + "\n" for i in range(3))
                   # a line a --skip-invalid submit refused: it has an id, and no answer
                   + json.dumps({"id": "bad", "model": "m", "prompt": "p", "max_tokens": 0}) + "\n")
    cdr.submit([item(i, 10) for i in range(3)], "a")
    cdr.claim(C, "dead")
    cdr.reclaim_dead("m")
    assert cdr.r.xlen(MK.dead) == 3 and cdr.status("a")["done"]
    p = retry.plan(cdr, "a", str(src))
    assert p.ids == {"0", "1", "2"} and p.permanent["validation"] == 1  # the refused line is not retried
    assert retry.submit(cdr, "a", "a.r", str(src), p, str(tmp_path / "a.r.jsonl")) == 3
    assert cdr.r.xlen(MK.dead) == 0  # the retried lines' dead letters left with them
    assert DeadLetter(cdr).retry(job="a") == {"retried": 0, "skipped": 0}
    drain(cdr, C)
    assert not [r.id for r in cdr.read_results("a") if r.error is None]  # the old job: its failed answers only
    assert sorted(r.id for r in cdr.read_results("a.r") if r.error is None) == ["0", "1", "2"]
