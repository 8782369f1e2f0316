"""A file's send pass (conductor/intake/file_intake.py ``Ahead``): the check builds only the first
chunk's items, the send builds each next chunk while Redis runs the one before (the submit
stream's ``idle``), every valid line goes once and in order, and a line that no longer checks
stops the intake with its line named instead of being skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conductor.client import Conductor
from conductor.errors import ConductorError
from conductor.intake import file_intake as fi
from tests.helpers import quick


def _write(path: Path, n: int, bad: frozenset[int] = frozenset()) -> None:
    with open(path, "w") as f:
        for i in range(1, n + 1):
            if i in bad:
                f.write('{"id": "broken"\n')
                continue
            f.write(json.dumps({"id": f"i{i}", "model": "m", "prefix": [f"shape {i % 7}"], "prompt": "p" * (i % 50),
                                "input_tokens": 10 + i % 40, "max_tokens": 4}) + "\n")


def test_chunks_start_with_the_kept_items_and_grow_at_most_twofold(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    _write(src, 9000, bad=frozenset({5, 4500}))
    found = fi.check_file(str(src), skip_invalid=True, rejects=None)
    assert len(found.kept) == fi.FIRST_CHUNK and found.kept_to == fi.FIRST_CHUNK + 1  # line 5 refused
    chunks = list(fi.Ahead(found, 3000))
    sizes = [len(c) for c in chunks]
    assert sizes[:2] == [3000, 1000]  # the kept items, in chunks of their own
    assert all(b <= max(3000, 2 * a) and b <= 3000 for a, b in zip(sizes, sizes[1:], strict=False))
    lines = [n for c in chunks for n, _ in c]
    assert lines == [n for n in range(1, 9001) if n not in (5, 4500)]
    assert [it.id for c in chunks for _, it in c] == [f"i{n}" for n in lines]


def test_the_next_chunk_is_built_while_the_stream_waits_on_redis(cdr: Conductor, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    quick(cdr)
    src = tmp_path / "in.jsonl"
    _write(src, 20_000)
    found = fi.check_file(str(src), skip_invalid=False, rejects=None)
    fi.prepare_job(cdr, found, "j")
    built_while_waiting = []
    real_idle = fi.Ahead.idle

    def idle(self: fi.Ahead, budget: int = fi.Ahead.BUILD_PER_WAIT) -> None:
        before = len(self._next)
        real_idle(self, budget)
        built_while_waiting.append(len(self._next) - before)
    monkeypatch.setattr(fi.Ahead, "idle", idle)
    out = fi.send_file(cdr, found, "j")
    assert out.accepted == 20_000 and cdr.status("j")["submitted"] == 20_000
    # the stream's waits built items of the chunks after the first (the iteration completes the rest)
    assert sum(built_while_waiting) > 8_000


def test_a_line_changed_after_the_check_stops_the_send_naming_it(cdr: Conductor, tmp_path: Path) -> None:
    quick(cdr)
    src = tmp_path / "in.jsonl"
    _write(src, 12_000)
    found = fi.check_file(str(src), skip_invalid=False, rejects=None)
    fi.prepare_job(cdr, found, "j")
    text = src.read_text().splitlines(keepends=True)
    text[9_999] = '{"id": "i10000", "model": "m"}\n'  # line 10,000 no longer a valid item
    src.write_text("".join(text))
    with pytest.raises(ConductorError, match="line 10000 .* was valid when checked and is not now"):
        fi.send_file(cdr, found, "j")
    st = cdr.status("j")
    # the chunks before the changed line went in whole; none after it
    assert 0 < st["submitted"] < 10_000
