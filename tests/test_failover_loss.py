"""Failover made visible (issue 13): a primary dies before its replica received a submit; the
promoted replica showed the job as submitted 0, pending 0, exit 0: a finished, empty job. Now
`conductor submit` declares the file's count before sending its items, and `conductor status`
reports the missing items as lost, with a non-zero exit and how to resubmit."""

from __future__ import annotations

import json
import time

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from tests.conftest import cli
from tests.helpers import MK, wait_for


def test_items_a_failover_lost_are_reported_and_a_resubmit_brings_them_back(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"i{k}", "model": "m", "prefix": ["sys"], "prompt": "p",
                                       "input_tokens": 10, "max_tokens": 4}) + "\n" for k in range(300)))
    primary = EmbeddedRedis().start()
    p = connect(primary.url)
    p.acl_setuser("repl", enabled=True, passwords=["+replpw"], keys=["*"], commands=["+@all"])
    replica = EmbeddedRedis(extra=["--replicaof", "127.0.0.1", str(primary.port), "--masteruser", "repl",
                                   "--masterauth", "replpw"]).start()
    try:
        r = connect(replica.url)
        wait_for(lambda: r.info("replication").get("master_link_status") == "up", "the replica never synced")
        # `conductor submit` declares the file's 300 items, then sends them. Here the replica takes
        # the declaration and then loses its link (its user switched off, it cannot reconnect)
        # before the items: what a primary dying a moment too early looks like.
        Conductor(p).declare("j", {"m": 300})
        wait_for(lambda: r.hget(MK.job_intake("j"), "declared") == b"300", "the declaration never replicated")
        p.acl_setuser("repl", enabled=False)
        p.client_kill_filter(user="repl")
        wait_for(lambda: r.info("replication").get("master_link_status") == "down", "the link stayed up")
        cli("submit", "--create", str(src), "--job", "j", "--resume", url=primary.url)  # into the declared job
        assert p.hget(MK.job_intake("j"), "submitted") == b"300"  # the producer saw all 300 accepted
        time.sleep(0.3)
        assert r.hget(MK.job_intake("j"), "submitted") is None  # the replica got none of them
        primary.kill()
        r.replicaof("NO", "ONE")
        st = cli("status", "j", url=replica.url, check=False)
        out, err = st.stdout.decode(), st.stderr.decode()
        assert st.returncode == 3, out + err
        assert "lost 300" in out and "declared 300, present 0" in err and "Submit the same file again" in err
        doc = json.loads(cli("status", "j", "--json", url=replica.url, check=False).stdout)
        assert (doc["lost"], doc["declared"], doc["submitted"]) == (300, 300, 0)
        # the same file again: the missing items come back, nothing is counted twice
        cli("submit", "--create", str(src), "--job", "j", "--resume", url=replica.url)
        st = cli("status", "j", url=replica.url, check=False)
        assert st.returncode == 0 and "lost" not in st.stdout.decode()
        assert json.loads(cli("status", "j", "--json", url=replica.url).stdout)["submitted"] == 300
    finally:
        replica.close()
        primary.close()
