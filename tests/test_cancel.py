"""Job lifecycle (issue 17): status and timestamps, cancel in bounded steps with in-flight batches
kept, expiry; counts that add up and a verify that finds nothing after either."""

import json
import time

from conductor.client import Conductor
from conductor.jobs import job_state
from conductor.redis_contract import keys as K
from conductor.verify import verify
from tests.conftest import cli, item
from tests.helpers import MK, contract, drain, quick, results_for


def submitted(c: Conductor, n: int, job: str = "j", **kw) -> None:
    quick(c)
    c.submit([item(f"i{k}", 10 + k % 7 * 20) for k in range(n)], job)
    job_state.start(c.r, job, **kw)


def results_by_id(c: Conductor, job: str) -> dict[str, dict]:
    rows = [json.loads(r) for r in c.results(job)]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an item answered twice"
    return {r["id"]: r for r in rows}


def test_cancel_answers_waiting_items_keeps_in_flight_ones_and_ends_cancelled(cdr, monkeypatch):
    monkeypatch.setattr(job_state, "STEP", 7)  # many bounded steps over the items hash
    submitted(cdr, 300)
    batch, _ = cdr.claim(contract(16), "w")
    assert batch is not None and len(batch.items) == 16
    d = job_state.cancel(cdr, "j")
    assert d["status"] == "cancelling" and d["cancelling_at"] and d["pending"] == 16
    assert d["request_counts"] == {"total": 300, "completed": 0, "failed": 284}
    # the answered items left the lanes: nothing waits, no claim finds work
    assert int(cdr.r.hget(MK.intake, "items") or 0) == 0
    assert cdr.claim(contract(16), "w2")[0] is None
    # the in-flight batch finishes and its results are kept
    assert cdr.complete(batch, results_for(batch)) == (16, 1)
    d = job_state.describe(cdr, "j")
    assert d["status"] == "cancelled" and d["cancelled_at"] >= d["cancelling_at"]
    assert d["finalizing_at"] is None  # a cancelled job ends without finalizing (OpenAI's batch alike)
    assert d["request_counts"] == {"total": 300, "completed": 16, "failed": 284} and d["pending"] == 0
    res = results_by_id(cdr, "j")
    assert len(res) == 300
    in_batch = {i.id for i in batch.items}
    for rid, r in res.items():
        if rid in in_batch:
            assert r["error"] is None and r["output"] == "out"
        else:
            assert r["error"]["code"] == "cancelled" and r["job"] == "j" and r["model"] == "m"
    rep = verify(cdr.r, "m", items=True)
    assert rep.ok, (rep.drift, rep.problems)
    # cancelling again changes nothing; a completed job cannot be cancelled
    assert job_state.cancel(cdr, "j")["request_counts"]["failed"] == 284


def test_a_job_left_alone_completes_with_its_timestamps(cdr):
    submitted(cdr, 20, metadata={"team": "a"})
    assert job_state.describe(cdr, "j")["status"] == "in_progress"
    drain(cdr, contract(8))
    d = job_state.describe(cdr, "j")
    assert d["status"] == "completed" and d["metadata"] == {"team": "a"}
    assert d["created_at"] <= d["in_progress_at"] <= d["finalizing_at"] <= d["completed_at"]
    try:
        job_state.cancel(cdr, "j")
    except Exception as e:  # noqa: BLE001
        assert "completed: nothing to cancel" in str(e)
    else:
        raise AssertionError("a completed job was cancelled")


def test_a_job_past_its_window_expires_keeping_what_finished(cdr):
    # a window long enough that a busy machine does not end it before the first sweep below
    submitted(cdr, 100, window_s=60, window="1m")
    batch, _ = cdr.claim(contract(10), "w")
    cdr.complete(batch, results_for(batch))
    assert job_state.expire_due(cdr) == []
    assert job_state.expire_due(cdr, now=time.time() + 61) == ["j"]
    d = job_state.describe(cdr, "j")
    assert d["status"] == "expired" and d["expired_at"] and d["completion_window"] == "1m"
    assert d["request_counts"] == {"total": 100, "completed": 10, "failed": 90}
    res = results_by_id(cdr, "j")
    assert sum(r["error"] is not None and r["error"]["code"] == "expired" for r in res.values()) == 90
    assert cdr.r.zscore(K.JOB_DEADLINES_KEY, "j") is None
    assert verify(cdr.r, "m", items=True).ok


def test_cancel_on_the_command_line(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"a{i}", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n"
                           for i in range(50)))
    cli("submit", "--create", str(src), "--job", "cj", "--completion-window", "24h", "--metadata", "team=x",
        url=redis_url)
    out = cli("status", "cj", url=redis_url).stdout.decode()
    assert out.startswith("job cj: in_progress | lines 50: 0 completed, 0 failed, 0 cancelled, 0 expired, "
                          "0 refused, 50 pending | items submitted 50, pending 50")
    assert "window 24h" in out and '{"team":"x"}' in out
    d = json.loads(cli("cancel", "cj", "--json", url=redis_url).stdout)
    assert d["status"] == "cancelled" and d["request_counts"] == {"total": 50, "completed": 0, "failed": 50}
    assert cli("status", "cj", url=redis_url).stdout.decode().startswith("job cj: cancelled")
    p = cli("cancel", "nope", url=redis_url, check=False)
    assert p.returncode == 2 and b"unknown" in p.stderr and b"Traceback" not in p.stderr
    p = cli("submit", "--create", str(src), "--job", "x", "--completion-window", "soon", url=redis_url, check=False)
    assert p.returncode == 2 and b"--completion-window" in p.stderr
    p = cli("inspect", "m", "--verify", url=redis_url, check=False)
    assert p.returncode == 0, p.stdout.decode() + p.stderr.decode()


def test_verify_finds_an_ended_job_whose_counts_do_not_add_up(cdr):
    """inspect --verify checks the lifecycle against the counts: a job recorded as cancelled (or
    completed, expired) with items here that have no result is a finding."""
    submitted(cdr, 20)
    assert verify(cdr.r, "m", items=True).ok
    cdr.r.hset(K.job_meta_key("j"), "status", "cancelled")  # as a sweep that died before answering
    rep = verify(cdr.r, "m", items=True)
    assert not rep.ok and any("is cancelled but 20 of its 20 items here have no result" in p for p in rep.problems)
    cdr.r.hset(K.job_meta_key("j"), "status", "in_progress")
    job_state.cancel(cdr, "j")  # a real cancel answers every item: the counts add up
    assert verify(cdr.r, "m", items=True).ok


def test_a_worker_expires_a_job_past_its_window_without_serve(redis_url):
    """Expiry needs no `conductor serve` and no `conductor expire`: the worker that holds a model's
    maintenance lease ends due jobs (here a job of another model, which no worker serves)."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    c = Conductor.from_url(redis_url)
    quick(c)
    c.submit([item(f"i{k}", 10) for k in range(30)], "late")  # model m: no worker serves it
    job_state.start(c.r, "late", window_s=1, window="1s")
    quick(c, "other")
    p = subprocess.Popen([sys.executable, "-m", "conductor", "--redis", redis_url, "--log-level", "warning",
                          "worker", "--engine", "sim", "--model", "other", "--name", "wx", "--idle-exit", "30"],
                         cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 20
        while job_state.describe(c, "late", advance=False)["status"] != "expired":
            assert time.monotonic() < deadline, job_state.describe(c, "late", advance=False)
            time.sleep(0.1)
    finally:
        p.terminate()
        p.wait(timeout=30)
    d = job_state.describe(c, "late", advance=False)
    assert d["request_counts"] == {"total": 30, "completed": 0, "failed": 30}
    assert {r["error"]["code"] for r in results_by_id(c, "late").values()} == {"expired"}
    assert verify(c.r, "m", items=True).ok


def test_expiry_has_one_owner_at_a_time(cdr):
    """Serve replicas and maintenance lease holders all call expire_due_leased: whoever holds the
    expiry lease sweeps, the others skip until it lapses."""
    submitted(cdr, 10, window_s=1, window="1s")
    assert job_state.expire_due_leased(cdr, "serve-a", lease_ms=60_000) == []  # nothing due yet:
    assert not cdr.r.exists(K.EXPIRY_LEASE_KEY)  # one read, no lease taken
    cdr.r.zadd(K.JOB_DEADLINES_KEY, {"j": 1})  # due now
    cdr.r.hset(K.job_meta_key("j"), "expires_at", 1)
    assert job_state.expire_due_leased(cdr, "serve-a", lease_ms=60_000) == ["j"]  # takes the lease
    assert job_state.describe(cdr, "j", advance=False)["status"] == "expired"
    cdr.r.zadd(K.JOB_DEADLINES_KEY, {"j": 1})  # due again (its end is idempotent)
    assert job_state.expire_due_leased(cdr, "worker-b", lease_ms=60_000) is None  # a holds it
    assert cdr.r.zscore(K.JOB_DEADLINES_KEY, "j") is not None  # untouched by b
    cdr.r.delete(K.EXPIRY_LEASE_KEY)  # the holder's lease lapsed: the next caller takes over
    assert job_state.expire_due_leased(cdr, "worker-b", lease_ms=60_000) == ["j"]
    assert cdr.r.zscore(K.JOB_DEADLINES_KEY, "j") is None  # ended already: only taken off the list
