"""A model name typed wrong is an error, not a new model for good: ``config`` and ``pause`` refuse an
unknown model unless ``--create``; a paused model refuses a submit with nothing left behind."""

import json

from tests.conftest import cli, item
from tests.test_cli_basics import one_line_error


def test_config_refuses_an_unknown_model_unless_create(redis_url, cdr):
    cdr.submit([item("a", 10, model="demo-7b")], "j")
    for argv in (["config", "demo-7c", "quiet_ms=5"], ["config", "demo-7c"]):
        err = one_line_error(cli(*argv, url=redis_url, check=False))
        assert "model 'demo-7c' is unknown to this Redis; did you mean 'demo-7b'? (known: demo-7b); --create makes it" \
            in err
    assert cdr.models() == ["demo-7b"] and not cdr.r.exists("cdr:{demo-7c}:cfg")
    out = cli("config", "demo-7c", "--create", "quiet_ms=5", url=redis_url).stdout.decode()
    assert "quiet_ms = 5" in out and cdr.models() == ["demo-7b", "demo-7c"]
    assert "quiet_ms = 7" in cli("config", "demo-7b", "quiet_ms=7", url=redis_url).stdout.decode()


def test_pause_refuses_an_unknown_model_unless_create(redis_url, cdr):
    for argv in (["pause", "typo"], ["resume", "typo"]):
        err = one_line_error(cli(*argv, url=redis_url, check=False))
        assert "model 'typo' is unknown to this Redis (known: none)" in err
    assert cdr.models() == []
    out = cli("pause", "early", "--create", url=redis_url).stdout.decode()
    assert cdr.models() == ["early"] and cdr.r.hget("cdr:{early}:state", "paused") == b"1"
    assert "producers are refused" in out and "workers wait" in out


def test_a_submit_to_a_paused_model_is_refused_and_leaves_no_job(redis_url, cdr, tmp_path):
    cdr.ensure_model("m")
    cli("pause", "m", url=redis_url)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n")
    err = one_line_error(cli("submit", "--create", str(src), "--job", "held", url=redis_url, check=False))
    assert "model m is paused" in err and "nothing submitted" in err
    assert json.loads(cli("jobs", "--json", url=redis_url).stdout) == []
    cli("resume", "m", url=redis_url)
    cli("submit", "--create", str(src), "--job", "held", url=redis_url)
    assert json.loads(cli("status", "held", "--json", url=redis_url).stdout)["submitted"] == 1
