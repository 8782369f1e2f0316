"""The streamed submit path (SUBMIT_WINDOW calls in flight) on a real redis-server."""

import pytest

from conductor.client import submit_stream as client_mod
from conductor.errors import BadInput
from conductor.redis_contract import script_calls
from tests.conftest import item


@pytest.fixture()
def small_chunks(monkeypatch):
    monkeypatch.setattr(client_mod, "SUBMIT_CHUNK", 10)


def test_many_calls_in_flight_submit_everything_once(cdr, small_chunks):
    rep = cdr.submit([item(i, 10 + i % 50) for i in range(95)], "j")
    assert (rep.accepted, rep.duplicates) == (95, 0)
    rep = cdr.submit([item(i, 10 + i % 50) for i in range(100)], "j")
    assert (rep.accepted, rep.duplicates) == (5, 95)
    assert cdr.status("j")["submitted"] == 100


def test_error_reply_stops_sending_and_earlier_calls_stay(cdr, small_chunks, monkeypatch):
    # The third call (items 20..29) carries a malformed job name; submit.lua refuses the whole call.
    good = [item(i, 10) for i in range(50)]
    monkeypatch.setattr(script_calls, "submit_args", _poison_third_call(script_calls.submit_args))
    with pytest.raises(BadInput, match="job"):
        cdr.submit(good, "j")
    # Calls 1 and 2 were applied; call 3 wrote nothing; at most SUBMIT_WINDOW - 1 later calls ran.
    submitted = cdr.status("j")["submitted"]
    assert 20 <= submitted <= 20 + 10 * (client_mod.SUBMIT_WINDOW - 1)
    assert submitted % 10 == 0


def test_noscript_mid_stream_is_sent_again(cdr, small_chunks):
    # A stale sha answers NOSCRIPT for every call: each chunk goes again through the Script
    # object, which reloads; nothing is lost or doubled.
    cdr.scripts.submit.sha = "0" * 40
    rep = cdr.submit([item(i, 10) for i in range(35)], "j")
    assert (rep.accepted, rep.duplicates) == (35, 0)
    assert cdr.status("j")["submitted"] == 35


def _poison_third_call(real):
    calls = {"n": 0}

    def wrapper(job, chunk):
        calls["n"] += 1
        args = real(job, chunk)
        if calls["n"] == 3:
            args[1] = "bad job!"
        return args
    return wrapper
