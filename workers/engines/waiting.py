"""What an engine was given and has not started, for the engines that model a real engine's limit
(sim, torch): at most max_num_seqs sequences run at once, the rest wait in order, and a batch may
start in parts. Its size is the engine's room as vLLM's is (workers/engines/vllm_engine.py): a
worker claims a batch only while under half the last batch waits, so it holds about one batch
beyond what runs and the backlog stays in Redis, where cancels, priorities and fair share act."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from conductor.redis_contract.records import Batch, BatchItem, Contract


class Waiting:
    def __init__(self, max_num_seqs: int, batch_size: int) -> None:
        self.max_num_seqs = max_num_seqs  # 0: no limit (everything starts at once)
        self._queue: deque[tuple[Batch, list[BatchItem]]] = deque()
        self.items = 0
        self._last_batch = batch_size  # the size of the last batch given: pacing's unit

    def add(self, batch: Batch, items: list[BatchItem]) -> None:
        self._last_batch = len(items)
        self._queue.append((batch, items))
        self.items += len(items)

    def startable(self, running: Callable[[], int]) -> Iterator[tuple[Batch, list[BatchItem]]]:
        """What may start now, oldest first, while fewer than max_num_seqs run; ``running`` is read
        again after the caller starts each part."""
        cap = self.max_num_seqs
        while self._queue and (cap <= 0 or running() < cap):
            batch, items = self._queue[0]
            n = len(items) if cap <= 0 else min(len(items), cap - running())
            if n < len(items):
                self._queue[0] = (batch, items[n:])
            else:
                self._queue.popleft()
            self.items -= n
            yield batch, items[:n]

    def room(self, batch_size: int) -> int | None:
        """A batch's worth once under half the last batch given waits, else none; None (no limit of
        its own) with max_num_seqs 0."""
        if self.max_num_seqs <= 0:
            return None
        return batch_size if 2 * self.items < self._last_batch else 0

    def clear(self) -> None:
        self._queue.clear()
        self.items = 0


class HoldsWaiting:
    """The part of an engine's protocol that its Waiting answers: its max_num_seqs and its room."""

    _waiting: Waiting
    _contract: Contract

    @property
    def max_num_seqs(self) -> int:
        """Sequences that run at once (0: no limit); the rest wait in the engine."""
        return self._waiting.max_num_seqs

    @max_num_seqs.setter
    def max_num_seqs(self, value: int) -> None:
        self._waiting.max_num_seqs = value

    def room(self) -> int | None:
        return self._waiting.room(self._contract.max_batch_size)
