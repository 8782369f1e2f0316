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


def _family(key: bytes) -> str:
    """The key's family as deploy/redis/users.acl grants keys: its first three parts
    (cdr:{m}:inst for cdr:{m}:inst:<sig>:<epoch>:fill)."""
    return ":".join(key.decode().split(":")[:3])


def _all_but(family: str) -> list[str]:
    """ACL key patterns that match every key name but ``family`` and ``family:*`` (Redis has no
    negative pattern): the names that leave it at some position, its proper prefixes, and the longer
    ones that go on with anything but a colon."""
    def esc(ch: str) -> str:
        return "\\" + ch if ch in "*?[]\\^" else ch
    pats, prefix = [], ""
    for ch in family:
        pats.append(f"~{prefix}[^{esc(ch)}]*")
        if prefix:
            pats.append(f"~{prefix}")
        prefix += esc(ch)
    return [*pats, f"~{prefix}[^:]*"]


def test_all_but_matches_every_key_but_a_family(admin):
    admin.acl_setuser("deny", enabled=True, reset=True, passwords=["+pw"], keys=_all_but("cdr:{m}:in?[c]"),
                      channels=["*"], commands=["+@all"])
    for k, allowed in ((b"cdr:{m}:in?[c]", False), (b"cdr:{m}:in?[c]:x", False), (b"cdr:{m}:in?[c]x", True),
                       (b"cdr:{m}:in?[", True), (b"cdr:{m}:inX[c]", True), (b"other", True), (b"c", True)):
        assert (admin.acl_dryrun("deny", "GET", k) == b"OK") is allowed, k


@pytest.mark.parametrize("script", sorted(H.SCENARIOS))
def test_a_refused_key_family_leaves_nothing_written(script, server, admin):
    """Each family of keys a scenario's call writes (cdr:{m}:inst, cdr:{m}:job, ...: the grain of
    deploy/redis/users.acl's producer role), refused to an ACL user allowed every other key and every
    command: the call is refused (its ACL pre-check covers every family it writes, those of key names
    it builds itself included) and nothing is written. A family it only reads, refused: if the call is
    refused, nothing is written either."""
    deny = redis.Redis.from_url(server.url.replace("redis://", "redis://deny:pw@"))
    for scenario in H.SCENARIOS[script]:
        admin.flushall()
        call = scenario(Conductor(admin))
        snap = H.snapshot(admin)
        dumps = {k: blob for k, _ttl, blob in snap}
        reply = H.run(admin, call)
        assert not isinstance(reply, redis.ResponseError), f"{scenario.__name__}: {reply}"
        after = {k: admin.dump(k) for k in admin.scan_iter(count=1000)}
        written = {_family(k) for k in dumps.keys() | after.keys() if dumps.get(k) != after.get(k)}
        for family in sorted({_family(k) for k in dumps.keys() | after.keys()}):
            H.restore(admin, snap)
            admin.acl_setuser("deny", enabled=True, reset=True, passwords=["+pw"], keys=_all_but(family),
                              channels=["*"], commands=["+@all"])
            before = H.fingerprint(admin)
            got = H.run(deny, call)
            if family in written:
                assert isinstance(got, redis.ResponseError), f"{scenario.__name__} without {family}: ran: {got}"
            if isinstance(got, redis.ResponseError):
                assert H.fingerprint(admin) == before, f"{scenario.__name__} without {family}: {got}, and wrote"
    deny.close()


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
