"""Redis Cluster readiness: every key a command or script touches lies in the slot of its model's
hash tag. A one-node cluster that owns all 16,384 slots checks that rule the way a real cluster
node does (CROSSSLOT for commands; for scripts, Redis 7 refuses a key outside the first key's
slot when the script has a shebang, and every conductor script has one).

A multi-node cluster (resharding, MOVED and ASK, a RedisCluster client) is not covered here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.redis_contract.scripts import source
from tests.conftest import ROOT, item

# The modules that run the scripts and the commands around them in this process, and the
# crash-and-restart test (CLUSTERDOWN after a restart): the default run's form.
CORE = ["tests/test_submit.py", "tests/test_claim.py", "tests/test_complete.py", "tests/test_reclaim.py",
        "tests/test_deadletter.py", "tests/test_verify.py", "tests/test_verify_live.py", "tests/test_migrations.py",
        "tests/test_lifecycle.py", "tests/test_faults.py::test_client_rides_out_a_redis_crash_and_restart"]
# The long form (pytest -m slow) adds the modules that go end to end through the CLI and worker
# processes: the same scripts, with the waits of processes starting and stopping.
END_TO_END = ["tests/test_e2e.py", "tests/test_verify_cli.py", "tests/test_worker_drain.py", "tests/test_cli.py",
              "tests/test_pause.py"]


@pytest.fixture(scope="module")
def cluster() -> EmbeddedRedis:
    srv = EmbeddedRedis(cluster=True).start()
    yield srv
    srv.close()


def test_the_one_node_cluster_refuses_what_a_cluster_refuses(cluster):
    # The check this module relies on: a script with a shebang touching two slots is refused,
    # a command on keys of two models is refused.
    r = connect(cluster.url)
    with pytest.raises(redis.ResponseError, match="same slot"):
        r.eval("#!lua\nredis.call('SET', 'cdr:{a}:x', 1)\nredis.call('SET', 'cdr:{b}:x', 1)", 1, "cdr:{a}:x")
    with pytest.raises(redis.ResponseError):
        r.delete("cdr:{a}:x", "cdr:{b}:x")


def test_every_script_has_a_shebang():
    # Without one, Redis 7 lets a script touch any slot of the node it runs on.
    for name in ("submit", "claim", "complete", "reclaim", "fail", "repair", "reindex", "dead_retry", "trim",
                 "trim_results"):
        assert source(name).startswith("#!lua"), name


def test_two_models_one_job_on_a_cluster_node(cluster):
    c = Conductor(connect(cluster.url))
    c.r.flushall()
    rep = c.submit([item(i, 10 + i % 30, model=("m1", "m2")[i % 2]) for i in range(200)], "j")
    assert rep.accepted == 200 and rep.models == {"m1", "m2"}
    assert c.status("j")["submitted"] == 200


# The default form leaves out the poison-worker processes of test_deadletter (12 s of the 30 on a
# cluster node: process starts and kills, no script or command the rest of the module does not run).
POISON = ["--deselect", "tests/test_deadletter.py::test_poison_item_is_dead_lettered_and_the_rest_of_its_job_completes"]


@pytest.mark.parametrize("modules", [CORE + POISON, pytest.param(CORE + END_TO_END, marks=pytest.mark.slow)],
                         ids=["core", "core-and-end-to-end"])
def test_core_modules_pass_on_a_one_node_cluster(modules):
    env = dict(os.environ, CONDUCTOR_TEST_CLUSTER="1")
    # -n 0: one process (the suite's two would each start a cluster run's worth of servers)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *modules],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=480)
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail
