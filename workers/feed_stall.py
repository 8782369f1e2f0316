"""A stalled feed is one alert, not a log loop (issue 25).

The maintenance lease holder feeds store segments into the lanes every 50 ms; a Redis over
maxmemory refused each load and the worker logged ``feed_failed`` each time (11,365 lines in one
run) while no alarm fired. Here a stall is a state: one line when it starts, one when it ends, a
gauge while it lasts (``conductor_feed_stalled``, its age in ``conductor_feed_stall_age_seconds``:
deploy/prometheus/alerts.yml ConductorFeedStalled) and a counter of the refused feeds.
"""

from __future__ import annotations

import json
import logging
import time

from conductor.observability import metrics

log = logging.getLogger("conductor.maintenance")


class FeedStall:
    def __init__(self, model: str, owner: str) -> None:
        self.model = model
        self.since: float | None = None  # monotonic start of the current stall
        self.failures = 0  # refused feeds of the current stall
        self._said = False  # its start was logged here (not by the worker's outage line)
        self._stalled = metrics.FEED_STALLED.labels(model, owner)
        self._age = metrics.FEED_STALL_AGE.labels(model, owner)
        self._failed = metrics.FEED_FAILURES.labels(model, owner)
        self._stalled.set(0)  # the series exist from the start: an alert reads 0, not "no data"
        self._age.set(0)

    def failed(self, e: BaseException, *, say: bool = True) -> bool:
        """A refused feed; True when it starts a stall (its one line is logged here when ``say``)."""
        self._failed.inc()
        self.failures += 1
        now = time.monotonic()
        if self.since is not None:
            self._age.set(now - self.since)
            return False
        self.since, self._said = now, say
        self._stalled.set(1)
        if say:
            log.warning(json.dumps({"event": "feed_stalled", "model": self.model, "error": str(e)}))
        return True

    def ok(self) -> None:
        """A feed went through: the stall, if any, ends (its second line, when its first was said
        here: a Redis outage has the worker's own pair of lines)."""
        if self.since is None:
            return
        lasted = time.monotonic() - self.since
        if self._said:
            log.warning(json.dumps({"event": "feed_resumed", "model": self.model, "stalled_s": round(lasted, 1),
                                    "refused_feeds": self.failures}))
        self.since, self.failures = None, 0
        self._stalled.set(0)
        self._age.set(0)
