"""JSONL and Parquet input, read in passes (conductor/intake/input_files.py, conductor/intake/file_intake.py)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from conductor.intake.input_files import scan
from conductor.redis_contract import keys as K
from tests.conftest import cli


def _native_rows(n: int, model: str = "m") -> list[dict]:
    return [{"id": f"r{i}", "model": model, "prefix": ["sys", f"s{i % 3}"], "prompt": f"question {i}",
             "input_tokens": 10 + i % 7, "max_tokens": 4, "payload": {"k": i}} for i in range(n)]


def test_parquet_native_columns_submit_like_the_same_jsonl(redis_url, tmp_path):
    rows = _native_rows(250)
    jl = tmp_path / "in.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pqf = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), pqf, row_group_size=64)
    cli("submit", "--create", str(jl), "--job", "j1", url=redis_url)
    cli("submit", "--create", str(pqf), "--job", "j2", url=redis_url)
    import redis
    r = redis.Redis.from_url(redis_url)
    mk = K.ModelKeys("m")
    assert r.hlen(mk.job_sums("j1")) == r.hlen(mk.job_sums("j2")) == 250
    assert r.hget(mk.job_intake("j2"), "declared") == b"250"
    assert r.hget(mk.job_intake("j2"), "submitted_tokens") == r.hget(mk.job_intake("j1"), "submitted_tokens")
    # the same content: the records of j2 are those of j1 with the job renamed
    s1 = {k: v for k, v in r.hgetall(mk.job_sums("j1")).items()}
    assert set(s1) == set(r.hgetall(mk.job_sums("j2")))
    # a re-run of the Parquet file adds nothing
    p = cli("submit", "--create", str(pqf), "--job", "j2", "--resume", url=redis_url)
    assert b"submitted 0 items (250 already there)" in p.stderr


def test_parquet_openai_columns_and_nulls(redis_url, tmp_path):
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-x", "max_tokens": 8 if i % 2 else None,
                      "max_completion_tokens": None if i % 2 else 6,
                      "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}]}}
            for i in range(6)]
    f = tmp_path / "oa.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    cli("submit", "--create", str(f), "--job", "oa", url=redis_url)
    insp = json.loads(cli("inspect", "gpt-x", "--json", url=redis_url).stdout)[0]
    assert len(insp["shapes"]) == 1 and insp["shapes"][0]["items"] == 6


def test_parquet_bad_rows_are_named_by_row_and_field(redis_url, tmp_path):
    rows = _native_rows(5)
    rows[2]["max_tokens"] = 0
    rows[4]["id"] = "r1"
    f = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    p = cli("submit", "--create", str(f), "--job", "b", url=redis_url, check=False)
    err = p.stderr.decode()
    assert p.returncode == 2
    assert "line 3: max_tokens" in err and "line 5: id: duplicate of line 2" in err and "nothing submitted" in err
    cols = tmp_path / "cols.parquet"
    pq.write_table(pa.Table.from_pylist([{**rows[0], "extra": 1}]), cols)
    p = cli("submit", "--create", str(cols), "--job", "b", url=redis_url, check=False)
    assert p.returncode == 2 and "extra: unknown column" in p.stderr.decode()
    st = cli("status", "b", url=redis_url, check=False)
    assert st.returncode == 2  # no job made


def test_scan_keeps_no_items_and_chunks_stream(tmp_path):
    rows = _native_rows(3000)
    f = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=500)
    found = scan(str(f))
    assert found.counts == {"m": 3000} and not found.refused
    assert not found.kept
    sizes = [len(c) for c in found.chunks(1000)]
    assert sizes == [1000, 1000, 1000]
    assert next(found.chunks(1000))[0][0] == 1  # row numbers from 1
