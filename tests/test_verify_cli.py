"""``conductor inspect --verify [--repair]`` through the command line, on a real redis-server."""

from __future__ import annotations

import json

from conductor.client import connect
from conductor.redis_contract import keys as K
from tests.conftest import cli


def _write_items(path, n=600, shapes=6):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"it{i}", "model": "vm", "prefix": [f"system {i % shapes}"],
                                "prompt": "x", "input_tokens": 20 + (i * 53) % 400, "max_tokens": 4}) + "\n")


def test_verify_after_an_end_to_end_run_reports_zero_difference(redis_url, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_items(src)
    cli("run", str(src), "--workers", "2", "--quiet-ms", "100", "-o", str(out),
        "--job", "e2e", url=redis_url, timeout=180)
    assert len(out.read_text().splitlines()) == 600
    p = cli("inspect", "vm", "--verify", url=redis_url, check=False)
    text = p.stdout.decode()
    assert p.returncode == 0, text + p.stderr.decode()
    assert "0 differ" in text and "<-- differs" not in text and "ledger" not in text
    # every model-level counter is printed next to its truth
    assert "cdr:{vm}:state" in text and "submitted" in text and "inflight_items" in text
    doc = json.loads(cli("inspect", "vm", "--verify", "--json", "--all", url=redis_url).stdout)[0]
    assert doc["differ"] == 0 and doc["checked"] == len(doc["rows"]) > 10
    rows = {(r["key"], r["field"]): r for r in doc["rows"]}
    assert rows[("cdr:{vm}:state", "completed")]["truth"] == 600
    assert rows[("cdr:{vm}:in:e2e", "submitted")]["recorded"] == 600


def test_a_corrupted_counter_is_caught_then_repaired(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    _write_items(src, n=120)
    cli("submit", "--create", str(src), "--job", "cj", url=redis_url)
    assert cli("inspect", "--verify", url=redis_url, check=False).returncode == 0
    r = connect(redis_url)
    mk = K.ModelKeys("vm")
    inst = r.zrange(mk.staged, 0, 0)[0].decode()
    r.hincrby(mk.inst(inst), "tokens", 1000)
    r.hincrby(mk.intake, "items", -3)
    p = cli("inspect", "vm", "--verify", url=redis_url, check=False)
    text = p.stdout.decode()
    assert p.returncode == 1
    lines = {tuple(ln.split()[:2]): ln.split()[-3] for ln in text.splitlines() if "<-- differs" in ln}
    # the instance against its lanes, and the model and staged score against the instance
    assert lines == {(mk.inst(inst), "tokens"): "+1000", (mk.intake, "tokens"): "-1000",
                     (mk.staged, inst): "-1000", (mk.intake, "items"): "-3"}
    p = cli("inspect", "vm", "--verify", "--repair", url=redis_url, check=False)
    text = p.stdout.decode()
    assert p.returncode == 0, text
    assert f"{mk.inst(inst)}  tokens:" in text and f"{mk.intake}  items:" in text
    assert "after repair: 0 counter(s) differ" in text
    assert cli("inspect", "vm", "--verify", url=redis_url, check=False).returncode == 0


def test_verify_on_an_empty_redis_and_unknown_model(redis_url):
    p = cli("inspect", "--verify", url=redis_url, check=False)
    assert p.returncode == 0 and "no models" in p.stdout.decode()
    p = cli("inspect", "nosuch", "--verify", url=redis_url, check=False)
    # a typo's empty model is not "0 differ" (issue 29): refused, naming the models there are
    assert p.returncode == 2 and "model 'nosuch' is unknown to this Redis" in p.stderr.decode()
