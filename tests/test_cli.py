import json

from tests.conftest import cli


def test_bad_lines_are_refused_with_line_and_field_and_nothing_is_submitted(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    good = {"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}
    lines = [
        json.dumps(good),
        json.dumps({**good, "id": "b", "max_tokens": "4"}),
        json.dumps({**good, "id": "c", "input_tokens": 0}),
        json.dumps({**good, "id": "d", "input_tokens": -5}),
        json.dumps({"foo": 1}),
        "{not json",
        json.dumps({k: v for k, v in good.items() if k != "prompt"} | {"id": "e"}),
        json.dumps({**good, "id": "f", "payload": "x" * (1024 * 1024 + 10)}),
        json.dumps({**good, "id": "a"}),
    ]
    src.write_bytes("\n".join(lines).encode() + b"\n" + b'{"id": "\xff\xfe", "model": "m"}\n')
    p = cli("submit", "--create", str(src), "--job", "bad", url=redis_url, check=False)
    err = p.stderr.decode()
    assert p.returncode == 2
    for needle in ("line 2: max_tokens", "line 3: input_tokens", "line 4: input_tokens", "line 5: format",
                   "line 6: line: not valid JSON", "line 7: prompt", "line 8: payload", "line 9: id: duplicate",
                   "line 10: line: invalid UTF-8", "nothing submitted"):
        assert needle in err, (needle, err)
    st = cli("status", "bad", url=redis_url, check=False)
    assert st.returncode == 2 and b"unknown" in st.stderr


def test_skip_invalid_submits_good_lines_and_writes_rejects(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n"
                   + json.dumps({"id": "b", "model": "m", "prompt": "hi", "max_tokens": 0}) + "\n")
    rejects = tmp_path / "rej.jsonl"
    cli("submit", "--create", str(src), "--job", "s", "--skip-invalid", "--rejects", str(rejects), url=redis_url)
    rej = [json.loads(x) for x in rejects.read_text().splitlines()]
    assert [(r["line"], r["field"]) for r in rej] == [(2, "max_tokens")]
    st = json.loads(cli("status", "s", "--json", url=redis_url).stdout)
    assert st["submitted"] == 1


def test_openai_batch_lines(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-x", "max_tokens": 8, "messages": [
                 {"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}]}}
            for i in range(5)]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cli("submit", "--create", str(src), "--job", "oa", url=redis_url)
    insp = json.loads(cli("inspect", "gpt-x", "--json", url=redis_url).stdout)[0]
    assert len(insp["shapes"]) == 1 and insp["shapes"][0]["items"] == 5


def test_unreachable_redis_is_one_clear_line(tmp_path):
    from conductor.embedded import free_port
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n")
    p = cli("submit", "--create", str(src), url=f"redis://127.0.0.1:{free_port()}/0", check=False, timeout=60)
    err = p.stderr.decode().strip()
    assert p.returncode == 2 and "Traceback" not in err
    assert err.startswith("conductor: cannot reach Redis at redis://127.0.0.1:")
    p = cli("status", "x", url="notaurl://", check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr.decode()


def test_latch_flags_both_or_neither(redis_url):
    p = cli("worker", "--engine", "sim", "--model", "m", "--high-water", "10", url=redis_url, check=False)
    assert p.returncode == 2 and b"--high-water and --low-water go together" in p.stderr


def test_config_and_migrate(redis_url):
    out = cli("migrate", url=redis_url).stdout.decode()
    assert "schema 6" in out
    out = cli("config", "m", "--create", "quiet_ms=250", "mode=disk", url=redis_url).stdout.decode()
    assert "quiet_ms = 250" in out and "mode = disk" in out
    p = cli("config", "m", "nope=1", url=redis_url, check=False)
    assert p.returncode == 2 and b"unknown field" in p.stderr


def test_trim_results_is_refused_while_work_is_left_then_trims(redis_url, tmp_path):
    import time

    from conductor.client import Conductor, connect
    from conductor.redis_contract.records import Contract
    from tests.helpers import drain, quick
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"i{k}", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n"
                           for k in range(5)))
    cli("submit", "--create", str(src), "--job", "t", url=redis_url)
    p = cli("trim-results", "t", "--older-than-s", "0", url=redis_url, check=False)
    assert p.returncode == 2 and b"without a result" in p.stderr  # nothing trimmed while items wait
    c = Conductor(connect(redis_url))
    quick(c)
    drain(c, Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096))
    time.sleep(0.01)
    out = cli("trim-results", "t", "--older-than-s", "0", url=redis_url).stdout.decode()
    assert "trimmed 5 result records" in out
    assert cli("results", "t", url=redis_url).stdout == b""
    assert json.loads(cli("status", "t", "--json", url=redis_url).stdout)["completed"] == 5
