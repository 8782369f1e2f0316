"""The disk tier on an object store (issue 18): segments in S3 through s3fs, against a local
S3-compatible endpoint (moto's server, a real HTTP S3 API in a process of its own)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conductor.client import Conductor
from conductor.embedded import free_port
from conductor.tier.feeder import Feeder
from conductor.tier.object_store import Store, StoreError
from tests.helpers import quick
from tests.test_disk_tier import _intake, _items, _run_down, _segments


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture()
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; s3fs (botocore) finds the endpoint and credentials in the environment."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(k, v)
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"conductor-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}/tier"


def test_segments_in_s3_are_fed_back_and_every_id_runs_once(redis_url, s3):
    c = Conductor.from_url(redis_url, store=Store(s3))
    c.ensure_model("m")
    quick(c, resident_tokens=1000)
    its = _items(200)
    c.submit(its, "j")
    assert _intake(c)["stored_items"] > 100
    objects = c.tier.store.fs.find(s3)
    assert objects and all(o.endswith(".parquet") for o in objects)  # the segments are S3 objects
    got = _run_down(c, Feeder(c, c.tier.store, "m"), items=its)
    assert sorted(got) == sorted(it.id for it in its)  # every id once, each batch of one shape
    st = _intake(c)
    assert (st["stored_tokens"], st["stored_items"]) == (0, 0) and _segments(c) == []
    assert c.tier.store.fs.find(s3) == []  # fed segments are removed from the bucket


def test_an_unreachable_object_store_is_one_clear_error_and_nothing_is_written(redis_url, s3, monkeypatch):
    import s3fs
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    c = Conductor.from_url(redis_url, store=Store(s3))
    c.ensure_model("m")
    quick(c, resident_tokens=100)
    before = {k: c.r.dump(k) for k in c.r.scan_iter("cdr:*")}
    with pytest.raises(StoreError, match=r"store s3://.*cannot"):
        c.submit(_items(50), "j")
    assert {k: c.r.dump(k) for k in c.r.scan_iter("cdr:*")} == before
