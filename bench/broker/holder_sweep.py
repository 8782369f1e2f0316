"""What one maintenance lease holder of a sharded model sends, by command (issue 36): a worker that
holds every part's lease (the model's own keys and each shard's) ticks workers/shard_maintenance.py
as its loop does, with nothing in flight and no idle beat standing for its lease calls, for
``--seconds``; the commands its connections send are counted by name (a script call by its
script's name, each command of a pipeline apart). Command counts do not depend on the machine's load.

    .venv/bin/python bench/broker/holder_sweep.py --shards 3 --consumers 8 --seconds 20

One Redis (a sharded model's layout works on one server too); ``--consumers`` idle consumers are
registered on every part with a live heartbeat on each (the full sweep reads one per consumer).

``--worker``: the real thing instead, a Worker (sim engine, its own thread, default 10 s heartbeat TTL)
alone on the model, so that it holds every part's lease, idle (workers/idle.py: its beats stand for
its sweeps' lease calls and XPENDING, its parts quiet); everything its connections send is counted
over ``--seconds`` after ``--settle`` seconds (past its parts' first full sweeps)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from redis.connection import AbstractConnection  # noqa: E402

from bench.common.report import command_line, git_rev, machine, now_utc, table  # noqa: E402
from conductor.client import Conductor, connect  # noqa: E402
from conductor.client.shard_claims import ShardClaims  # noqa: E402
from conductor.embedded import EmbeddedRedis  # noqa: E402
from conductor.redis_contract import keys as K  # noqa: E402
from conductor.redis_contract import script_calls as calls  # noqa: E402
from conductor.redis_contract.records import Contract  # noqa: E402
from conductor.workers import shard_maintenance  # noqa: E402


def _names(packed: bytes, shas: dict[str, str]) -> list[str]:
    """The command names in ``packed`` (RESP arrays), a script call as lua:<script>."""
    out, pos = [], 0
    while pos < len(packed):
        eol = packed.index(b"\r\n", pos)
        n = int(packed[pos + 1:eol])
        pos = eol + 2
        args = []
        for _ in range(n):
            eol = packed.index(b"\r\n", pos)
            ln = int(packed[pos + 1:eol])
            args.append(packed[eol + 2:eol + 2 + ln])
            pos = eol + 2 + ln + 2
        name = args[0].decode().upper()
        out.append(shas.get(args[1].decode(), name) if name == "EVALSHA" else name)
    return out


def _model(c: Conductor, shards: int, consumers: int, config: dict[str, Any]) -> tuple[str, list[str], dict[str, str]]:
    """The model "holdy" with ``consumers`` idle consumers registered on each of its parts; returns the
    model, its parts and the scripts' names by sha."""
    model = "holdy"
    c.set_config(model, config)
    names = [model, *c.ensure_shards(model)] if shards > 1 else [model]
    now = int(time.time() * 1000)
    for name in names:
        c.ensure_model(name)
        mk = K.ModelKeys(name)
        for i in range(consumers):
            contract = Contract(model=name, max_batch_size=8, max_batch_tokens=4096, max_input_len=4096)
            calls.register(mk, f"w{i}", "{}", contract, now, 600_000).run(c.scripts)
            c.r.xgroup_createconsumer(mk.batches, K.GROUP, f"w{i}")
    return model, names, {getattr(c.scripts, k).sha: f"lua:{k}" for k in c.scripts.__annotations__}


@contextmanager
def _counting(seen: Counter[str], shas: dict[str, str]) -> Iterator[None]:
    """Every command any connection of this process sends, counted by name into ``seen``."""
    orig: Any = AbstractConnection.send_packed_command

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        data = command if isinstance(command, (bytes, bytearray, memoryview)) else b"".join(command)
        seen.update(_names(bytes(data), shas))
        orig(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        AbstractConnection.send_packed_command = orig  # type: ignore[method-assign]


def measure(shards: int, consumers: int, seconds: float) -> tuple[float, Counter[str]]:
    """Commands a second the holder of every part sent, in all and by name."""
    seen: Counter[str] = Counter()
    with EmbeddedRedis() as srv:
        c = Conductor(connect(srv.url))
        model, _parts, shas = _model(c, shards, consumers, {"shards": shards})
        sm = shard_maintenance.for_worker(c, ShardClaims(c, model), "holder", 10.0)
        for m in sm.parts.values():
            m.verify_interval_s = 0  # the drift check runs in a thread of its own, every 60 s
        sm.tick()  # every lease taken, every part's first (full) sweep
        with _counting(seen, shas):
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                sm.tick()
                time.sleep(max(0.0, min(0.05, sm.due_in())))
            took = time.monotonic() - t0
    return sum(seen.values()) / took, Counter({k: v / took for k, v in seen.items()})


def measure_worker(shards: int, consumers: int, seconds: float, settle: float) -> tuple[float, Counter[str]]:
    """Commands a second an idle Worker holding every part's lease sent, in all and by name."""
    import threading

    from conductor.workers.engines.sim import SimEngine
    from conductor.workers.worker import Worker, WorkerOptions

    seen: Counter[str] = Counter()
    with EmbeddedRedis() as srv:
        c = Conductor(connect(srv.url))
        model, names, shas = _model(c, shards, consumers, {"shards": shards} if shards > 1 else {"quiet_ms": 50})
        w = Worker(Conductor(connect(srv.url)), SimEngine(model, max_batch_size=8, max_batch_tokens=4096),
                   WorkerOptions(name="holder"))
        t = threading.Thread(target=w.run, daemon=True)
        t.start()
        try:
            time.sleep(settle)
            held = {n: c.r.get(K.ModelKeys(n).maint_lease) for n in names}
            assert all(v == b"holder" for v in held.values()), held
            # the benchmark's own thread sleeps through the window: all that is sent is the worker's
            with _counting(seen, shas):
                t0 = time.monotonic()
                time.sleep(seconds)
                took = time.monotonic() - t0
        finally:
            w.request_stop()
            t.join(15)
    return sum(seen.values()) / took, Counter({k: v / took for k, v in seen.items()})


def duties(shards: int, consumers: int) -> list[list[str]]:
    """What a quiet part's seldom duties send, counted once each on one Redis (the model's part and a
    shard's), and amortized over their periods (workers/maintenance.py, workers/shard_maintenance.py): a
    ``--worker`` window of minutes holds at most one of each, so its figure is a floor of the steady state."""
    from conductor.verify import watch_drift
    from conductor.workers import maintenance as mt

    with EmbeddedRedis() as srv:
        c = Conductor(connect(srv.url))
        model, names, shas = _model(c, shards, consumers, {"shards": shards} if shards > 1 else {"quiet_ms": 50})
        sm = shard_maintenance.for_worker(c, ShardClaims(c, model), "holder", 10.0)
        for m in sm.parts.values():
            m.verify_interval_s = 0
        sm.tick()  # every lease taken, every part's first (full) sweep

        def sent(fn: Any) -> int:
            seen: Counter[str] = Counter()
            with _counting(seen, shas):
                fn()
            return sum(seen.values())

        def quiet_tick(name: str, full: bool) -> int:
            part = sm.parts[name]
            part.quiet, part._next = True, 0.0
            part._full_next = 0.0 if full else float("inf")
            part._told_until = part._told_idle_until = time.monotonic() + 60  # its beat's lease answer
            return sent(lambda: part.tick(may_quiet=True))

        kinds = [("the model's part", model, 1)]
        if shards > 1:
            kinds.append(("a shard's part", names[-1], shards))
        verify_s = float(os.environ.get("CONDUCTOR_VERIFY_INTERVAL_S", "60")) * mt.QUIET_VERIFY_FACTOR
        rows: list[list[str]] = []
        total = 0.0
        for what, name, n in kinds:
            full = quiet_tick(name, True) - quiet_tick(name, False)
            drift = sent(lambda name=name: watch_drift(c.r, name, pause_s=0))
            for duty, cmds, period in (("full sweep", full, mt.QUIET_FULL_SWEEP_S), ("drift check", drift, verify_s)):
                rate = n * cmds / period
                total += rate
                rows.append([duty, what, str(n), str(cmds), f"{period:.0f}", f"{rate:.3f}"])
        if shards > 1:
            fair = sent(lambda: sm.fair.sync(names))
            rate = fair / shard_maintenance.QUIET_FAIR_S
            total += rate
            rows.append(["tenants' combine", "the model's part", "1", str(fair),
                         f"{shard_maintenance.QUIET_FAIR_S:.0f}", f"{rate:.3f}"])
        rows.append(["all", "", "", "", "", f"{total:.3f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--consumers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--worker", action="store_true", help="an idle Worker holding every lease, not its sweeps alone")
    ap.add_argument("--settle", type=float, default=25.0, help="--worker: seconds before the window")
    ap.add_argument("--duties", action="store_true",
                    help="a quiet part's seldom duties (full sweep, drift check, combine): commands each, amortized")
    args = ap.parse_args()
    if args.duties:
        print(f"Command: `{command_line()}`  \nRun: {now_utc()}, commit {git_rev()}; {machine()}\n")
        print(table(["duty", "part", "parts", "commands each", "period s (quiet)", "commands/s"],
                    duties(args.shards, args.consumers)))
        return
    if args.worker:
        total, by = measure_worker(args.shards, args.consumers, args.seconds, args.settle)
    else:
        total, by = measure(args.shards, args.consumers, args.seconds)
    print(f"Command: `{command_line()}`  \nRun: {now_utc()}, commit {git_rev()}; {machine()}\n")
    what = "an idle worker holding every lease" if args.worker else "the holder of every part"
    print(table(["shards", "consumers", f"commands/s, {what}"],
                [[args.shards, args.consumers, f"{total:.2f}"]]))
    print()
    print(table(["command", "per second"], [[k, f"{v:.2f}"] for k, v in by.most_common()]))


if __name__ == "__main__":
    main()
