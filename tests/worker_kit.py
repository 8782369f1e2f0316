"""Shared set-up for the worker tests: a real Worker over a real SimEngine on the test's Redis."""

from __future__ import annotations

import threading

from conductor.client import Conductor
from conductor.workers.engines.sim import SimEngine
from conductor.workers.worker import Worker, WorkerOptions
from tests.conftest import item
from tests.helpers import quick


def sim(model: str = "m", **kw) -> SimEngine:
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_batch_tokens", 8192)
    kw.setdefault("max_input_len", 4096)
    return SimEngine(model, **kw)


def worker(c: Conductor, engine=None, **opts) -> Worker:
    opts.setdefault("name", "w1")
    w = Worker(c, engine or sim(), WorkerOptions(**opts))
    w.register()
    return w


def submit(c: Conductor, n: int, tokens: int = 10, max_tokens: int = 16, job: str = "j", model: str = "m",
           start: int = 0) -> list[str]:
    quick(c, model)
    ids = [f"i{k:04d}" for k in range(start, start + n)]
    c.submit([item(i, tokens, model=model, max_tokens=max_tokens) for i in ids], job)
    return ids


def run_until_done(w: Worker, job: str = "j", turns: int = 10_000) -> int:
    """Drive turns until every item of ``job`` has a result; returns the turns it took."""
    for t in range(turns):
        w.turn()
        if w.c.status(job)["done"] and not w.engine.active() and not w.retry:
            return t
    raise AssertionError(f"job {job} not done after {turns} turns: {w.c.status(job)}")


def stop_fleet(workers: list[Worker], threads: list[threading.Thread]) -> None:
    """Worker loops run in threads: each asked to stop, joined, its connection closed."""
    for w in workers:
        w.request_stop()
    for t in threads:
        t.join(20)
    for w in workers:
        w.c.r.close()
