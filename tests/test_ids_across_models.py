"""One id, one result per job (issue 13): an id is unique within a job across its models. The
same id under two models of one job was accepted (8,100 result lines for 8,000 ids)."""

from __future__ import annotations

import json

import pytest

from conductor.errors import DuplicateId
from tests.conftest import cli, item


def _everything(r) -> dict:
    return {k: r.dump(k) for k in r.scan_iter(count=1000)}


def _line(i: str, model: str) -> str:
    return json.dumps({"id": i, "model": model, "prompt": "p", "input_tokens": 5, "max_tokens": 4})


def test_a_file_with_one_id_under_two_models_is_refused_naming_the_line(cdr, redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_line("x", "a"), _line("y", "a"), _line("x", "b")]) + "\n")
    p = cli("submit", "--create", str(src), "--job", "j", url=redis_url, check=False)
    err = p.stderr.decode()
    assert p.returncode != 0
    assert "line 3: id: duplicate of line 1 (there for model a: an id names one item of a job" in err, err
    assert not list(cdr.r.scan_iter(match="cdr:{*"))  # nothing submitted


def test_an_id_the_job_has_under_another_model_is_refused_naming_the_line(cdr, redis_url, tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(_line("x", "a") + "\n")
    second.write_text("\n".join([_line("z", "b"), _line("x", "b")]) + "\n")
    cli("submit", "--create", str(first), "--job", "j", url=redis_url)
    before = _everything(cdr.r)
    p = cli("submit", "--create", str(second), "--job", "j", "--resume", url=redis_url, check=False)
    err = p.stderr.decode()
    assert p.returncode != 0
    assert "line 2: id: 'x' is already in job j under model a" in err, err
    assert _everything(cdr.r) == before
    # the same file again, and another job, are fine
    cli("submit", "--create", str(first), "--job", "j", "--resume", url=redis_url)
    cli("submit", "--create", str(second), "--job", "k", url=redis_url)


def test_the_client_refuses_before_writing(cdr):
    cdr.submit([item("x", 10, model="a")], "j")
    before = _everything(cdr.r)
    with pytest.raises(DuplicateId, match="'y' is given for models a and b"):
        cdr.submit([item("y", 10, model="a"), item("y", 10, model="b")], "j")
    with pytest.raises(DuplicateId, match="'x' is already in job j under model a"):
        cdr.submit([item("w", 10, model="b"), item("x", 10, model="b")], "j")
    assert _everything(cdr.r) == before
    rep = cdr.submit([item("x", 10, model="a"), item("w", 10, model="b")], "j")  # a re-run: idempotent
    assert (rep.accepted, rep.duplicates) == (1, 1)
    assert cdr.status("j")["submitted"] == 2
