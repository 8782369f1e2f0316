"""A model's shapes sharded over a three-master Redis Cluster (issue 36; conductor/redis_contract/shards.py):
a job end to end through the command line and sim worker processes, every id once, its results merged
and followed; cancel, retry and verify over it; a worker killed mid-batch, its batches reclaimed on
their shard; the count changed 1 -> 3 -> 1 with work waiting, nothing lost nothing twice."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedCluster
from conductor.redis_contract import shards as S
from tests.conftest import cli, follow_with_workers


@pytest.fixture(scope="module")
def cluster():
    with EmbeddedCluster(3) as c:
        yield c


def _lines(path, n: int, model: str, shapes: int = 12, start: int = 0) -> None:
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"c{i}", "model": model, "prefix": [f"sys {i % shapes}"], "prompt": "x",
                                "input_tokens": 20 + i % 90, "max_tokens": 8}) + "\n")


def test_shard_names_land_on_their_part_of_the_slots():
    for count in (2, 3, 6):
        names = S.shard_names("llama", count)
        assert [S.slot_of(n) * count // S.SLOTS for n in names] == list(range(count))
        assert {S.fold(n) for n in names} == {"llama"}
    assert S.shard_names("llama", 1) == ["llama"] and S.fold("llama") == "llama"


def test_a_job_over_three_shards_end_to_end_through_the_cli(cluster, tmp_path):
    url, model = cluster.url, "shardy"
    cli("config", model, "--create", "quiet_ms=200", "shards=3", url=url)
    rc = connect(url)
    names = S.shard_names(model, 3)
    assert len({rc.get_node_from_key(f"cdr:{{{n}}}").name for n in names}) == 3
    src = tmp_path / "in.jsonl"
    _lines(src, 1500, model)
    assert cli("submit", str(src), "--job", "sj", url=url).stdout.decode().strip() == "sj"
    c = Conductor(rc)
    per_shard = {n: c.status("sj")["models"].get(n, {}).get("submitted", 0) for n in names}
    assert sum(per_shard.values()) == 1500 and all(per_shard.values()), per_shard
    rows = follow_with_workers(url, "sj", tmp_path / "out.jsonl", [(model, "w1"), (model, "w2")],
                               batch_size=32, batch_tokens=4096, timeout=180)
    ids = Counter(r["id"] for r in rows)
    assert set(ids) == {f"c{i}" for i in range(1500)} and set(ids.values()) == {1}
    assert {r["model"] for r in rows} == {model}
    st = json.loads(cli("status", "sj", "--json", url=url).stdout)
    assert (st["status"], st["submitted"], st["completed"], st["pending"]) == ("completed", 1500, 1500, 0)
    assert list(st["models"]) == [model]
    out = cli("results", "sj", url=url).stdout.decode().splitlines()
    assert Counter(json.loads(x)["id"] for x in out) == ids
    vj = cli("verify-job", "sj", url=url, check=False)
    assert vj.returncode == 0, vj.stdout.decode() + vj.stderr.decode()
