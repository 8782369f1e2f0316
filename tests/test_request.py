"""The request path (conductor/client/request.py) against a real redis-server and real worker processes."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conductor import AsyncRequestClient, RequestClient
from conductor.client import Conductor, connect
from conductor.client.permits import Permits
from conductor.errors import BadInput, ClientClosed, QueueFull, RequestTimeout, UnknownModel
from tests.helpers import MK, quick
from tests.test_doorbell import start_worker, stop, wait_live


@pytest.fixture()
def fleet(redis_url):
    """Two sim worker processes serving model m."""
    r = connect(redis_url)
    quick(Conductor(r))
    procs = [start_worker(redis_url, f"w{i}") for i in range(2)]
    try:
        wait_live(r, {"w0", "w1"})
        yield redis_url
    finally:
        stop(procs)


def test_unknown_model_is_refused_naming_the_served_ones(fleet):
    with pytest.raises(UnknownModel) as e:
        RequestClient(fleet, model="nobody-serves-this")
    assert e.value.served == ["m"] and "'nobody-serves-this'" in str(e.value) and "m" in str(e.value)


def test_generate_returns_the_result_record_and_the_permit(fleet):
    with RequestClient(fleet, model="m", max_in_flight=4) as rc:
        assert rc.available_permits == 4 and rc.in_flight == 0
        res = rc.generate("hello", prefix=("sys",), max_tokens=8, timeout=10, payload={"k": 1})
        assert res.error is None and res.output and res.model == "m" and res.job == rc.job
        assert res.payload == {"k": 1}
        assert rc.available_permits == 4
        # the same record the results readers get, and its reply list was read empty
        rows = Conductor(connect(fleet)).read_results(rc.job)
        assert [r.id for r in rows] == [res.id] and rows[0] == res
        assert not connect(fleet).exists(MK.reply(rc.job, res.id))
        cap = rc.capacity()
        assert cap.workers == 2 and cap.fleet_budget_tokens == 2 * 8192 and cap.waiting_tokens == 0
        with pytest.raises(BadInput, match="max_tokens"):
            rc.generate("x", max_tokens=0, timeout=1)
        with pytest.raises(BadInput, match="timeout"):
            rc.generate("x", max_tokens=1, timeout=0)
        assert rc.available_permits == 4


def test_queue_full_carries_the_waiting_figure_and_returns_the_permit(fleet):
    c = Conductor(connect(fleet))
    with RequestClient(fleet, model="m", max_in_flight=2) as rc:
        c.set_config("m", {"max_waiting_tokens": 5})
        with pytest.raises(QueueFull) as e:
            rc.generate("a prompt long enough to pass five tokens", max_tokens=4, timeout=5)
        assert e.value.waiting == 0
        assert rc.available_permits == 2


def _ghost_worker(redis_url: str) -> None:
    """A live registration without a running process: the identity check passes, nothing claims."""
    r = connect(redis_url)
    c = Conductor(r)
    quick(c)
    r.hset(MK.workers, "ghost", '{"max_batch_tokens": 100}')
    r.set(MK.heartbeat("ghost"), 1, px=60_000)
    c.ensure_model("m")


def test_timeout_and_close_return_permits(redis_url):
    """No worker runs the item: the request times out; a request waiting when the client closes
    wakes with ClientClosed at once; both permits come back."""
    _ghost_worker(redis_url)
    rc = RequestClient(redis_url, model="m", max_in_flight=2)
    t = time.monotonic()
    with pytest.raises(RequestTimeout):
        rc.generate("p", max_tokens=4, timeout=0.3)
    assert 0.25 <= time.monotonic() - t < 2 and rc.available_permits == 2
    got: list[BaseException] = []

    def waiter() -> None:
        try:
            rc.generate("p", max_tokens=4, timeout=30)
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    deadline = time.monotonic() + 5
    while rc.in_flight != 1 or not rc._core.waiting_on:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t = time.monotonic()
    rc.close()
    th.join(5)
    assert isinstance(got[0], ClientClosed) and time.monotonic() - t < 2
    assert rc.available_permits == 2
    with pytest.raises(ClientClosed):
        rc.generate("p", max_tokens=4, timeout=1)


def test_a_leaked_permit_comes_back_at_its_safety_deadline():
    p = Permits(2)
    a = p.try_take(0.2)
    assert a is not None and p.try_take(0.2) is not None
    assert p.try_take(10) is None and p.available == 0
    t = time.monotonic()
    b = p.take(10, wait_s=2)  # blocks until the first safety deadline returns a permit
    assert b is not None and 0.15 <= time.monotonic() - t < 1 and p.reaped >= 1
    assert p.give(a) is False  # returned by the deadline already: not counted twice
    assert p.give(b) is True and p.give(b) is False


def test_many_concurrent_requests_with_random_timeouts_threads(fleet):
    """300 threads over 64 permits, a third with short timeouts: every request ends (result or
    timeout), every permit is back, and every result a caller got is the stored one."""
    rng = random.Random(4)
    with RequestClient(fleet, model="m", max_in_flight=64) as rc:
        def one(k: int):
            try:
                return rc.generate(f"p{k}", max_tokens=4, timeout=rng.choice((0.05, 20, 20)))
            except RequestTimeout:
                return None
        with ThreadPoolExecutor(300) as ex:
            out = list(ex.map(one, range(300)))
        assert rc.available_permits == 64 and rc.in_flight == 0
        got = [r for r in out if r is not None]
        assert len(got) >= 150
        assert len({r.id for r in got}) == len(got)
        stored = {r.id: r for r in Conductor(connect(fleet)).read_results(rc.job)}
        assert all(stored[r.id] == r for r in got)


def test_async_stress_cancel_and_permits(fleet):
    """1,000 concurrent tasks with random timeouts and some cancelled: every permit comes back,
    every answered request has the stored result, and no reply list of an answered one is left."""
    async def main() -> None:
        rng = random.Random(7)
        async with AsyncRequestClient(fleet, model="m", max_in_flight=64) as rc:
            async def one(k: int):
                try:
                    return await rc.generate(f"q{k}", max_tokens=4, timeout=rng.choice((0.05, 30, 30, 30)))
                except RequestTimeout:
                    return None
            tasks = [asyncio.create_task(one(k)) for k in range(1000)]
            await asyncio.sleep(0.05)
            cancelled = [t for t in tasks[::50] if t.cancel()]
            out = await asyncio.gather(*tasks, return_exceptions=True)
            assert rc.available_permits == 64 and rc.in_flight == 0
            assert cancelled and all(isinstance(out[k * 50], asyncio.CancelledError) or out[k * 50] is None
                                     or not isinstance(out[k * 50], Exception) for k in range(20))
            got = [r for r in out if r is not None and not isinstance(r, BaseException)]
            assert len(got) >= 500
            stored = {r.id: r for r in Conductor(connect(fleet)).read_results(rc.job)}
            assert all(stored[r.id] == r for r in got)
            r = connect(fleet)
            assert not any(r.exists(MK.reply(rc.job, x.id)) for x in got)
    asyncio.run(main())


def test_async_cancel_while_waiting_returns_the_permit(redis_url):
    _ghost_worker(redis_url)

    async def main() -> None:
        async with AsyncRequestClient(redis_url, model="m", max_in_flight=1) as rc:
            task = asyncio.create_task(rc.generate("p", max_tokens=4, timeout=30))
            while rc.in_flight != 1:
                await asyncio.sleep(0.01)
            second = asyncio.create_task(rc.generate("p", max_tokens=4, timeout=30))  # waits for the permit
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.1)
            assert rc.in_flight == 1  # the waiting one took the permit the cancelled one gave back
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            assert rc.available_permits == 1
            with pytest.raises(RequestTimeout):
                await rc.generate("p", max_tokens=4, timeout=0.2)
            assert rc.available_permits == 1
    asyncio.run(main())


def test_a_request_survives_its_worker_killed_mid_run(redis_url):
    """The worker running a request is SIGKILLed: the request still completes, once, on another."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT
    r = connect(redis_url)
    quick(Conductor(r))

    def worker(name: str, scale: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "conductor", "--log-level", "warning", "worker", "--engine",
                                 "sim", "--model", "m", "--name", name, "--max-batch-size", "8", "--max-batch-tokens",
                                 "8192", "--max-input-len", "4096", "--heartbeat-ttl", "1", "--sim-time-scale", scale],
                                env=dict(os.environ, CONDUCTOR_REDIS_URL=redis_url), cwd=str(ROOT))
    slow = worker("slow", "20")  # 64 decode steps take seconds: killed while it runs
    procs = [slow]
    try:
        wait_live(r, {"slow"})
        with RequestClient(redis_url, model="m") as rc:
            with ThreadPoolExecutor(1) as ex:
                fut = ex.submit(rc.generate, "survive", max_tokens=64, timeout=60)
                deadline = time.monotonic() + 10
                while not r.xpending_range(MK.batches, "workers", "-", "+", 1, consumername="slow"):
                    assert time.monotonic() < deadline, "the slow worker never claimed"
                    time.sleep(0.01)
                os.kill(slow.pid, signal.SIGKILL)
                slow.wait(10)
                procs = [worker("fast", "0")]
                res = fut.result(60)
            assert res.error is None and res.worker == "fast" and res.deliveries == 2
            stored = Conductor(r).read_results(rc.job)
            assert [x.id for x in stored] == [res.id]
            assert rc.available_permits == 64
    finally:
        stop(procs)
