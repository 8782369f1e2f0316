"""Jobs from the operator's side, through the real CLI: the job list, unknown jobs as errors (also
when following or watching), a re-submit with other content refused with nothing written, an
empty file making no job."""

import json

import pytest

from conductor.errors import Conflict
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
from tests.conftest import cli, item
from tests.helpers import drain, quick, results_for, submit_argv
from tests.test_cli_basics import one_line_error

CONTRACT = Contract(model="m", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows(n, model="m", prompt="hi", start=0):
    return [{"id": f"i{k}", "model": model, "prompt": f"{prompt} {k}", "max_tokens": 4}
            for k in range(start, start + n)]


def test_jobs_lists_every_job_with_its_counters_and_state(redis_url, cdr, tmp_path):
    assert cli("jobs", url=redis_url).stdout.decode().strip() == "no jobs"
    quick(cdr)
    cli("submit", "--create", write(tmp_path / "a.jsonl", rows(3)), "--job", "done-job", url=redis_url)
    drain(cdr, CONTRACT)
    cli("submit", "--create", write(tmp_path / "b.jsonl", rows(2)), "--job", "failing-job", url=redis_url)
    b, _ = cdr.claim(CONTRACT, "w")
    cdr.complete(b, results_for(b, error=True))
    cli("submit", "--create", write(tmp_path / "c.jsonl", rows(4) + rows(1, model="n", start=4)), "--job", "open-job",
        url=redis_url)
    listed = json.loads(cli("jobs", "--json", url=redis_url).stdout)
    got = {r["job"]: (r["models"], r["submitted"], r["completed"], r["failed"], r["pending"], r["state"])
           for r in listed}
    # OpenAI's status names, as conductor status and the Batch API show them (issue 29): a job whose
    # items all failed is completed (failed means its input was refused)
    assert got == {"done-job": (["m"], 3, 3, 0, 0, "completed"), "failing-job": (["m"], 2, 0, 2, 0, "completed"),
                   "open-job": (["m", "n"], 5, 0, 0, 5, "in_progress")}
    assert [r["job"] for r in listed] == ["done-job", "failing-job", "open-job"]  # oldest first
    assert all(r["created_ms"] > 0 for r in listed)
    text = cli("jobs", url=redis_url).stdout.decode().splitlines()
    assert text[0].split() == ["job", "created", "models", "lines", "completed", "failed", "cancelled", "expired",
                               "refused", "pending", "items", "tenant", "priority", "deadline", "state"]
    assert text[3].split()[0] == "open-job" and \
        text[3].split()[-13:] == ["m,n", "5", "0", "0", "0", "0", "0", "5", "5", "-", "batch", "-", "in_progress"]
    assert [r["job"] for r in json.loads(cli("jobs", "--json", "--limit", "1", url=redis_url).stdout)] == \
        ["open-job"]


@pytest.mark.parametrize("argv", [["status", "nope"], ["status", "nope", "--watch"], ["results", "nope"],
                                  ["results", "nope", "--follow"], ["results", "nope", "--follow", "-o", "OUT"]])
def test_an_unknown_job_is_an_error_also_when_following(redis_url, cdr, tmp_path, argv):
    cdr.submit([item("a", 10)], "real")
    out = tmp_path / "out.jsonl"
    argv = [str(out) if a == "OUT" else a for a in argv]
    err = one_line_error(cli(*argv, url=redis_url, check=False, timeout=30))
    assert "job 'nope' is unknown" in err and "conductor jobs" in err
    assert not out.exists()  # nothing opened, nothing truncated


def test_a_resubmit_with_other_content_is_refused_and_writes_nothing(redis_url, cdr, tmp_path):
    first = write(tmp_path / "prompts.jsonl", rows(5))
    cli("submit", "--create", first, url=redis_url)
    before = {k: cdr.r.dump(k) for k in sorted(cdr.r.scan_iter("cdr:*"))}
    # another file under the same default job name: two ids clash, one is new
    (tmp_path / "other").mkdir()
    other = write(tmp_path / "other" / "prompts.jsonl",
                  rows(2, prompt="different") + rows(2, start=2) + rows(1, start=9))
    # without --resume the job that exists is refused at once (issue 37: as run refuses it)
    err = one_line_error(cli("submit", "--create", other, url=redis_url, check=False))
    assert "job prompts exists in this Redis (5 items, 0 answered): --resume adds what it lacks" in err
    err = one_line_error(cli("submit", "--create", "--resume", other, url=redis_url, check=False))
    assert "job prompts already has 2 of these ids with other content" in err and "nothing submitted" in err
    assert {k: cdr.r.dump(k) for k in sorted(cdr.r.scan_iter("cdr:*"))} == before
    # the same content again stays an idempotent duplicate
    p = cli("submit", "--create", "--resume", first, url=redis_url)
    assert b"submitted 0 items (5 already there)" in p.stderr
    # another shape under a known id is other content too
    moved = [{**r, "prefix": ["new system prompt"]} for r in rows(1)]
    err = one_line_error(cli("submit", "--create", write(tmp_path / "m.jsonl", moved), "--job", "prompts",
                             "--resume", url=redis_url, check=False))
    assert "already has 1 of these ids" in err


def test_the_script_refuses_a_conflict_itself_with_nothing_written(cdr):
    # two producers racing past the client's check: submit.lua is the one that decides
    sig = "0123456789abcdef"
    mk = K.ModelKeys("m")
    cdr.submit([item("x", 10)], "j")
    cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=submit_argv("j", ("a", sig, 10, 5)))
    before = {k: cdr.r.dump(k) for k in sorted(cdr.r.scan_iter("cdr:*"))}
    for args in (submit_argv("j", ("b", sig, 10, 5), ("a", sig, 11, 5)),  # a known id, other tokens
                 submit_argv("j", ("c", sig, 10, 5), ("c", sig, 10, 6))):  # one id twice in a call
        with pytest.raises(Exception, match="^CONFLICT 1 ids of this call"):
            cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=args)
    assert {k: cdr.r.dump(k) for k in sorted(cdr.r.scan_iter("cdr:*"))} == before
    assert cdr.scripts.submit(keys=[mk.base, mk.cfg, mk.state], args=submit_argv("j", ("a", sig, 10, 5))) == [-1]
    with pytest.raises(Conflict, match="1 of these ids"):
        cdr.submit([item("x", 11)], "j")


def test_an_empty_file_makes_no_job_and_says_so(redis_url, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    err = one_line_error(cli("submit", "--create", str(empty), url=redis_url, check=False))
    assert err == f"conductor: {empty} holds no items: no job made"
    assert json.loads(cli("jobs", "--json", url=redis_url).stdout) == []
    err = one_line_error(cli("run", str(empty), "-o", str(tmp_path / "o.jsonl"), url=redis_url, check=False))
    assert "holds no items" in err


def test_status_watch_exits_1_when_items_failed(redis_url, cdr):
    quick(cdr)
    cdr.submit([item("a", 10), item("b", 10)], "j")
    b, _ = cdr.claim(CONTRACT, "w")
    cdr.complete(b, results_for(b, error=True))
    p = cli("status", "j", "--watch", url=redis_url, check=False, timeout=30)
    assert p.returncode == 1 and b"failed 2" in p.stdout
