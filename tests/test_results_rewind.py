"""Issue 13: a results reader following by position across a failover read results again. The
old primary acknowledged results that never reached its replica; the reader had read them. After
the replica is promoted, workers produce those results again. The reader now detects that the
stream ends before its position, says so, skips the second copies and exits 1."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.redis_contract.records import Contract
from tests.conftest import ROOT
from tests.helpers import drain, quick, results_for, wait_for
from tests.netfault import ReplyDroppingProxy

wait = partial(wait_for, timeout=30.0)  # a replica sync and a reader process on a busy machine
C = Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096)



def test_a_reader_across_a_failover_says_the_stream_rewound_and_prints_each_id_once(tmp_path):
    from tests.conftest import item
    primary = EmbeddedRedis().start()
    p = connect(primary.url)
    p.acl_setuser("repl", enabled=True, passwords=["+replpw"], keys=["*"], commands=["+@all"])
    replica = EmbeddedRedis(extra=["--replicaof", "127.0.0.1", str(primary.port), "--masteruser", "repl",
                                   "--masterauth", "replpw"]).start()
    proxy = ReplyDroppingProxy(primary.port)
    reader = None
    try:
        r = connect(replica.url)
        wait(lambda: r.info("replication").get("master_link_status") == "up", "the replica never synced")
        c = Conductor(p)
        quick(c)
        c.submit([item(f"i{k}", 10) for k in range(40)], "j")
        first = 0
        for _ in range(3):
            b, _why = c.claim(C, "w1")
            c.complete(b, results_for(b, "w1"))
            first += len(b.items)
        out = tmp_path / "out.jsonl"

        def read() -> list[str]:
            """What the reader wrote so far: under a temporary name until it is done (issue 29)."""
            part = sorted(tmp_path.glob(".out.jsonl.*.part"))
            return (part[0] if part else out).read_text().splitlines() if part or out.exists() else []
        reader = subprocess.Popen([sys.executable, "-m", "conductor", "--redis", proxy.url, "results", "j", "--follow",
                                   "-o", str(out)], cwd=str(ROOT), stderr=subprocess.PIPE)
        wait(lambda: len(read()) == first, "the reader never caught up")
        wait(lambda: r.xlen("cdr:{m}:job:j:results") == first, "the results never replicated")
        # the link goes down; the primary acknowledges the rest of the job, the reader reads it
        p.acl_setuser("repl", enabled=False)
        p.client_kill_filter(user="repl")
        wait(lambda: r.info("replication").get("master_link_status") == "down", "the link stayed up")
        drain(c, C, consumer="w1")
        wait(lambda: len(read()) == 40, "the reader never read the whole job")
        # failover: the primary dies, the replica is promoted behind the same address
        primary.kill()
        r.replicaof("NO", "ONE")
        proxy.retarget(replica.port)
        # the promoted replica lost the last results: their items are done again by a new worker
        c2 = Conductor(connect(replica.url))
        c2.reclaim_dead("m")
        drain(c2, C, consumer="w2")
        assert c2.status("j")["done"]
        rc = reader.wait(timeout=60)
        err = reader.stderr.read().decode()
        ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
        assert sorted(ids) == sorted(f"i{k}" for k in range(40)), "an id printed twice or missing"
        assert rc == 1 and "was rewound" in err and f"{40 - first} results" in err, (rc, err)
    finally:
        if reader is not None:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
            reader.stderr.close()
        proxy.close()
        replica.close()
        primary.close()
