"""No script half-writes (issue 13): every script of lua/, brought by tests/script_harness.py to
each of its branches, is run once per command it may call as an ACL user allowed everything but
that command; whenever a script errors, the whole database is as it was (DEBUG DIGEST plus the
streams' groups and pending entries). The same check under fuzzed arguments."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis

from conductor.client import Conductor
from conductor.embedded import EmbeddedRedis
from tests import script_harness as H


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    srv = EmbeddedRedis(extra=["--enable-debug-command", "yes"]).start()
    yield srv
    srv.close()


@pytest.fixture()
def admin(server) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(server.url)
    r.flushall()
    yield r
    r.close()


def test_every_script_is_covered():
    assert sorted(H.SCENARIOS) == H.scripts_in_lua()


@pytest.mark.parametrize("script", sorted(H.SCENARIOS))
def test_a_refused_command_leaves_nothing_written(script, server, admin):
    seen: set[str] = set()
    deny = redis.Redis.from_url(server.url.replace("redis://", "redis://deny:pw@"))
    for scenario in H.SCENARIOS[script]:
        admin.flushall()
        call = scenario(Conductor(admin))
        assert call.script == script
        snap = H.snapshot(admin)
        reply, names = H.called(admin, call)
        assert not isinstance(reply, redis.ResponseError), f"{scenario.__name__}: {reply}"
        assert call.check is None or call.check(admin), f"{scenario.__name__}: did not reach its branch"
        seen |= names
        for cmd in sorted(names):
            H.restore(admin, snap)
            admin.acl_setuser("deny", enabled=True, reset=True, passwords=["+pw"], keys=["*"], channels=["*"],
                              commands=["+@all", f"-{cmd}"])
            before = H.fingerprint(admin)
            got = H.run(deny, call)
            assert isinstance(got, redis.ResponseError), f"{scenario.__name__} without {cmd}: ran anyway: {got}"
            assert H.fingerprint(admin) == before, f"{scenario.__name__} without {cmd}: {got}, and wrote"
    deny.close()
    # every command the script may call was reached by one scenario or another
    assert H.script_commands(script) <= seen, sorted(H.script_commands(script) - seen)


JUNK: list[object] = ["", "0", "-1", "1.5", "1e308", "-1e308", "nan", "inf", "0x10", " 1", "5001", "65537",
                      str(2**63), str(2**64), "99999999999999999999999-0", "18446744073709551616-0",
                      "1-18446744073709551616", "0-0", "1-0", "-", "+", "x" * 600, "{\"a\":1}",
                      "[1,2,{\"x\":null}]", "[", "null", "[]", "[\"a\",\"j\",1,1,\"p\"]", b"\xff\xfe", "\x00",
                      "j", "w", "ok", "err", "deadbeefdeadbeef", "deadbeefdeadbeef:1", "0000000000000000:0"]


def mutations(args: list, rng: random.Random) -> list:
    out = list(args)
    for _ in range(rng.choice((1, 1, 2, 3))):
        what = rng.random()
        if what < 0.6 and out:
            out[rng.randrange(len(out))] = rng.choice(JUNK)
        elif what < 0.75 and out:
            del out[rng.randrange(len(out))]
        elif what < 0.9:
            out.insert(rng.randrange(len(out) + 1), rng.choice(JUNK))
        elif out:
            out[0] = str(rng.choice((0, 1, 2, 3, 5000, 5001, 10**6, -3)))
    return out


def substitutions(args: list) -> Iterator[list]:
    """Each argument in turn (the first 12 and the last 4) replaced by each junk value."""
    positions = sorted(set(range(min(12, len(args)))) | set(range(max(0, len(args) - 4), len(args))))
    for i in positions:
        for junk in JUNK:
            yield [*args[:i], junk, *args[i + 1:]]


@pytest.mark.parametrize("script", sorted(H.SCENARIOS))
def test_fuzzed_arguments_leave_nothing_written_when_refused(script, admin):
    """Every argument of the script's first scenario replaced by every junk value, then random
    mutations (wrong counts, dropped and extra arguments) in every scenario."""
    rng = random.Random(f"issue13-{script}")
    tried = errors = 0
    for n, scenario in enumerate(H.SCENARIOS[script]):
        admin.flushall()
        call = scenario(Conductor(admin))
        snap = H.snapshot(admin)
        cases = [mutations(call.args, rng) for _ in range(30)]
        if n == 0:
            has_args = bool(call.args)
            cases += list(substitutions(call.args))
        for args in cases:
            before = H.fingerprint(admin)
            got = H.run(admin, H.Call(script, call.keys, args))
            tried += 1
            if isinstance(got, redis.ResponseError):
                errors += 1
                assert H.fingerprint(admin) == before, f"{scenario.__name__} {args!r:.300}: {got}, and wrote"
                # a refusal the script gave, not a Lua runtime error halfway
                assert "user_script" not in str(got), f"{scenario.__name__} {args!r:.300}: {got}"
            else:
                H.restore(admin, snap)
    if has_args:  # a script without arguments (seal) ignores extra ones
        assert errors > tried // 4
