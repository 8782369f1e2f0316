"""An idle worker's wait: block on the model's doorbell instead of polling claim.lua.

submit.lua pushes one entry to ``cdr:{model}:bell`` per full batch a call adds (at most 16, the
list is trimmed to 16) and seal.lua one; an idle worker BLPOPs it, so it wakes within a
millisecond of new work and sends nothing while there is none. A blocked client costs Redis
nothing: 20 idle workers that polled with a back-off up to 50 ms sent about 2,400 commands/s
(bench/RESULTS.md, "Idle fleet").

The wait is bounded by the next moment something could change without a ring: the maintenance
tick (reclaim sweep: a dead worker's batches come back), and, when the claim answered 'gate' or
'wait' (the release gate or the active shape waiting for quiet intake or a full batch), the
model's quiet_ms, after which a claim may dispatch what it held back. Aging and lane hygiene are
time-driven too; the maintenance period (1 s) bounds their delay. After a claim that found nothing
at all ('idle'), the wait is workers/idle.py's: the doorbell until the next beat, a few seconds,
with no timed claim (issue 36).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from conductor.client import Conductor
from conductor.redis_contract.config import DEFAULTS
from conductor.redis_contract.keys import ModelKeys

from .transient import RIDE_OUT, is_transient

BELL_CAP = 16  # as submit.lua and seal.lua trim it
# Claim answers after which the next change is time-driven (quiet intake), not only a ring.
_TIMED = ("gate", "wait")
_CFG_REFRESH_S = 5.0


class StopWaiting(Exception):
    """A stop signal's handler raises this into the BLPOP it interrupts (Doorbell.interrupt)."""


class Doorbell:
    def __init__(self, conductor: Conductor, model: str) -> None:
        self.r = conductor.r
        self.keys = ModelKeys(model)
        self._quiet_s = float(DEFAULTS.get("quiet_ms", 1000)) / 1000
        self._quiet_read = 0.0
        self.rings = 0  # wake-ups by a ring, not by the timeout (tests, metrics)
        # the thread blocked in BLPOP right now, if any: a stop signal cuts that wait (interrupt)
        self._blocked_in: int | None = None

    def quiet_s(self) -> float:
        """The model's quiet_ms in seconds, read at most every few seconds (one HGET)."""
        now = time.monotonic()
        if now - self._quiet_read > _CFG_REFRESH_S:
            self._quiet_read = now
            raw = self.r.hget(self.keys.cfg, "quiet_ms")
            try:
                self._quiet_s = max(0.0, float(raw) / 1000) if raw is not None else self._quiet_s
            except ValueError:
                pass
        return self._quiet_s

    def wait(self, limit_s: float, last_claim: str) -> bool:
        """Block until a ring or ``limit_s`` (shorter after 'gate'/'wait'); True when rung.
        Redis errors propagate: the caller rides them out as it does a failed claim."""
        timeout = limit_s
        if last_claim in _TIMED:
            timeout = min(timeout, self.quiet_s())
        # BLPOP takes a decimal timeout in seconds (Redis 6+); 0 would block for ever
        timeout = max(0.001, round(timeout, 3))
        try:
            try:
                self._blocked_in = threading.get_ident()
                got = self.r.blpop([self.keys.doorbell], timeout=timeout)
            finally:
                self._blocked_in = None
        except StopWaiting:
            # redis-py dropped the connection the reply was owed on; the next command opens another
            self._blocked_in = None
            return False
        if got is not None:
            self.rings += 1
            return True
        return False

    def interrupt(self) -> None:
        """Called by a stop signal's handler: if this thread is blocked in the BLPOP (a signal handler
        runs in the main thread, between two of its bytecodes), raise StopWaiting there, so that
        systemd's or a test's SIGTERM ends an idle worker at once, not after its block (up to
        MAX_BLOCK_S, 5 s). Python retries a read that a signal cut (PEP 475): without this the
        stop waits for the BLPOP's timeout."""
        if self._blocked_in == threading.get_ident():
            raise StopWaiting

    def wait_idle(self, due_in_s: float, idle_exit_s: float | None, idle_since: float,
                  last_claim: str, on_error: Callable[[BaseException], object] | None = None) -> bool | None:
        """An idle worker's wait: until a ring, its next timed duty (``due_in_s``) or its idle exit.
        True when rung; None after a transient Redis error (the caller backs off as it does after
        a failed claim; ``on_error`` hears of it: an outage starts there as well as anywhere);
        other errors propagate."""
        limit = due_in_s
        if idle_exit_s is not None:
            limit = min(limit, idle_exit_s - (time.monotonic() - idle_since) + 0.01)
        return ride_out(lambda: self.wait(limit, last_claim), on_error)

    def pass_on(self) -> None:
        """A worker that a ring woke and that found work rings once more: if work is left, the next
        idle worker wakes too (submit.lua rings once per full batch, seal.lua once); if not, that
        worker's claim finds nothing and it blocks again."""
        pipe = self.r.pipeline(transaction=False)
        pipe.lpush(self.keys.doorbell, 1)
        pipe.ltrim(self.keys.doorbell, 0, BELL_CAP - 1)
        pipe.execute()


def poll_sleep(sleep: float, poll_max_s: float) -> float:
    """The old idle wait (``WorkerOptions(wake="poll")``, kept for the benchmark's before/after and
    as the fallback while Redis is away): sleep, then double up to ``poll_max_s``."""
    time.sleep(sleep)
    return min(sleep * 2, poll_max_s)


def ride_out(wait: Callable[[], bool], on_error: Callable[[BaseException], object] | None) -> bool | None:
    """An idle wait's answer, or None after a transient Redis error (``on_error`` hears of it, the
    caller backs off as after a failed claim); other errors propagate."""
    try:
        return wait()
    except RIDE_OUT as e:
        if not is_transient(e):
            raise
        if on_error is not None:
            on_error(e)
        return None
