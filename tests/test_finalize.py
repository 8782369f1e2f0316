"""A batch's finalizing step (issue 25): once every line is answered a batch is ``finalizing`` while
its output and error files are written (conductor/api/finalize.py), then ``completed``. Cancel and
expiry during finalizing still answer every line once, and a serve killed (SIGKILL) while it writes
the files leaves a batch that a restarted serve completes. Real serve and worker processes, a real
redis-server, the official openai SDK; CONDUCTOR_TEST_PAUSE_AT=output_write stops the finalizer with
the first batch's output file written under its temporary name, not yet in place."""

from __future__ import annotations

import io
import time
from collections import Counter

import redis
from openai import OpenAI

from conductor.api.finalize import LEASE_MS
from conductor.redis_contract import keys as K
from tests.test_durable_intake import kill, start_serve, wait_paused
from tests.test_serve import KEY, follow, jsonl, lines_of, request, stop, worker

N = 30


def _batch(client: OpenAI, tag: int, window: str = "24h") -> tuple[str, list[str]]:
    rows = [request(1000 * tag + i) for i in range(N)]
    f = client.files.create(file=(f"in{tag}.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)
    return b.id, [r["custom_id"] for r in rows]


def _exact(client: OpenAI, batch_id: str, ids: list[str], status: str) -> tuple[list[dict], list[dict]]:
    b = client.batches.retrieve(batch_id)
    assert b.status == status, b
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert Counter(x["custom_id"] for x in out + err) == Counter(ids)  # every line once over the two files
    rc = b.request_counts
    assert (rc.total, rc.completed, rc.failed) == (len(ids), len(out), len(err)), b
    return out, err


def test_finalizing_is_recorded_survives_a_killed_serve_and_yields_to_cancel_and_expiry(redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    data = tmp_path / "files"
    p, base = start_serve(redis_url, data, CONDUCTOR_TEST_PAUSE_AT="output_write")
    client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    w = worker(redis_url)
    try:
        # the first batch (this serve's first intake) stops in its finalizer, files half written
        held, held_ids = _batch(client, 0)
        wait_paused(r, held, "output_write", timeout=90)
        b = client.batches.retrieve(held)
        assert b.status == "finalizing" and b.finalizing_at and b.output_file_id is None, b
        assert r.hget(K.job_meta_key(held), "status") == b"finalizing"  # recorded, not only derived
        assert b.created_at <= b.finalizing_at and b.completed_at is None
        # two more, answered while the finalizer is held: finalizing from their last answer
        cancelled, c_ids = _batch(client, 1)
        expired, e_ids = _batch(client, 2)
        for job in (cancelled, expired):
            b = follow(client, job, {"finalizing", "completed", "cancelled", "expired", "failed"}, timeout=90)
            assert b.status == "finalizing" and b.finalizing_at, b
        # cancel during finalizing: cancelled, each line once (all of them were run)
        assert client.batches.cancel(cancelled).status == "cancelled"
        out, err = _exact(client, cancelled, c_ids, "cancelled")
        assert len(out) == N and err == []
        # expiry during finalizing: its window set to have passed (serve's expiry loop ends it)
        now = int(time.time())
        r.hset(K.job_meta_key(expired), "expires_at", now)
        r.zadd(K.JOB_DEADLINES_KEY, {expired: now})
        follow(client, expired, {"expired"}, timeout=60)
        out, err = _exact(client, expired, e_ids, "expired")
        assert len(out) == N and err == []
    finally:
        kill(p)  # SIGKILL with the first batch's files half written
    assert r.hget(K.job_meta_key(held), "status") == b"finalizing"
    assert list(data.glob(f".file-out-{held}.*.part"))  # the temporary file it left
    assert not (data / f"file-out-{held}.jsonl").exists()
    # the killed serve still holds the finalize lease; a restarted serve takes over once it lapses. The
    # lapse is brought forward (it would come LEASE_MS after the last renewal) instead of waited out.
    assert 0 < r.pttl(K.FINALIZE_LEASE_KEY) <= LEASE_MS
    r.pexpire(K.FINALIZE_LEASE_KEY, 100)

    p, base = start_serve(redis_url, data)
    client = OpenAI(base_url=base + "/v1", api_key=KEY)
    try:
        b = follow(client, held, {"completed", "cancelled", "expired", "failed"}, timeout=90)
        out, err = _exact(client, held, held_ids, "completed")
        assert len(out) == N and err == [] and b.error_file_id is None
        assert b.created_at <= b.finalizing_at <= b.completed_at, b
        assert (data / f"file-out-{held}.jsonl").exists()  # served from the file the finalizer wrote
        meta = r.hgetall(K.job_meta_key(held))
        assert (meta[b"output_lines"], meta[b"error_lines"]) == (str(N).encode(), b"0")
        assert r.zscore(K.BATCHES_OPEN_KEY, held) is None
        for job, status in ((cancelled, "cancelled"), (expired, "expired")):  # the finalizer left them as they ended
            assert client.batches.retrieve(job).status == status
        wait = time.monotonic() + 30
        while r.zscore(K.BATCHES_OPEN_KEY, cancelled) is not None or r.zscore(K.BATCHES_OPEN_KEY, expired) is not None:
            assert time.monotonic() < wait, "ended batches stayed in the open index"
            time.sleep(0.2)
        # a fresh batch goes the whole way: validating -> in_progress -> finalizing -> completed
        job, ids = _batch(client, 3)
        b = follow(client, job, {"completed", "cancelled", "expired", "failed"}, timeout=90)
        _exact(client, job, ids, "completed")
        assert b.created_at <= b.finalizing_at <= b.completed_at, b
    finally:
        stop(w)
        stop(p)
