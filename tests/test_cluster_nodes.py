"""A three-node Redis Cluster (no replicas): each model's keys live on the node owning its hash
tag's slot. Through the command line with a cluster URL (`?cluster=1`): one job over three
models on three nodes, a worker process per model, results read back across the nodes.

Not covered: resharding (MOVED/ASK mid-run), replicas and failover."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedCluster
from conductor.verify import verify
from tests.conftest import cli, follow_with_workers

MODELS = ("alpha", "bravo", "echo")  # slots in the first, second and third third


@pytest.fixture(scope="module")
def cluster():
    with EmbeddedCluster(3) as c:
        yield c


def test_the_models_live_on_three_nodes(cluster):
    rc = connect(cluster.url)
    nodes = {rc.get_node_from_key(f"cdr:{{{m}}}").name for m in MODELS}
    assert len(nodes) == 3  # else this module would not test what it says


def test_one_job_three_models_three_nodes_through_the_cli(cluster, tmp_path):
    url = cluster.url
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(1200):
            f.write(json.dumps({"id": f"c{i}", "model": MODELS[i % 3], "prefix": [f"sys {i % 4}"],
                                "prompt": "x", "input_tokens": 20 + i % 90, "max_tokens": 8}) + "\n")
    for m in MODELS:
        cli("config", m, "quiet_ms=200", url=url)
    assert cli("submit", str(src), "--job", "cj", url=url).stdout.decode().strip() == "cj"
    rows = follow_with_workers(url, "cj", tmp_path / "out.jsonl", [(m, f"w-{m}") for m in MODELS],
                               batch_size=32, batch_tokens=4096, timeout=180)
    ids = Counter(r["id"] for r in rows)
    assert set(ids) == {f"c{i}" for i in range(1200)} and set(ids.values()) == {1}
    assert {r["worker"] for r in rows} == {f"w-{m}" for m in MODELS}
    assert all(r["worker"] == f"w-{r['model']}" for r in rows)
    st = json.loads(cli("status", "cj", "--json", url=url).stdout)
    assert (st["submitted"], st["completed"], st["pending"]) == (1200, 1200, 0)
    c = Conductor(connect(url))
    for m in MODELS:
        rep = verify(c.r, m, items=True)
        assert rep.ok, rep.drift
        insp = json.loads(cli("inspect", m, "--json", url=url).stdout)[0]
        assert insp["consumers"] == [] and insp["state"]["inflight_items"] == "0"
