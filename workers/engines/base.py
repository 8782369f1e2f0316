"""The engine protocol: what the worker needs from anything that generates text.

An engine does continuous batching: ``admit`` new sequences (a prefill), ``step`` advances
every active sequence (a decode step) and hands back the finished ones. The worker derives
its contract (batch size, batch tokens, input length) and its identity (model name) from the
engine, never from its own flags.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from conductor.errors import ConductorError
from conductor.redis_contract.records import Batch, BatchItem, Contract, ResultError


class EngineUnavailable(ConductorError):
    """The chosen engine cannot run here (its package is missing); the CLI prints it in one line."""


class EngineConfigError(ConductorError, ValueError):
    """A bad engine flag, named at the start of the message (``--model-path: ...``)."""


class EngineDead(ConductorError):
    """Raised by ``step``: the engine cannot go on (its process died). The worker gives back every
    batch it holds (they run again elsewhere, answered once) and exits non-zero, for systemd to restart."""


class EngineOutage(ConductorError):
    """Raised by ``step``: what serves the engine went away (a server down or restarting). The engine
    has dropped its unfinished requests; the worker gives their batches back (not a failure of the items)
    and claims again once ``room`` is above 0."""


class Finished:
    """One sequence that left the engine, with its output or a per-item error."""

    __slots__ = ("batch", "item", "output", "output_tokens", "error")

    def __init__(self, batch: Batch, item: BatchItem, output: str, output_tokens: int,
                 error: ResultError | None = None) -> None:
        self.batch = batch
        self.item = item
        self.output = output
        self.output_tokens = output_tokens
        self.error = error


def too_long(batch: Batch, item: BatchItem, max_input_len: int) -> Finished:
    """An item longer than the engine takes: an empty output and an error, never a stall."""
    return Finished(batch, item, "", 0, ResultError(
        "input_too_long", f"input_tokens {item.input_tokens} exceeds this engine's max_input_len {max_input_len}"))


class ContractHolder:
    """The identity and contract an engine derives from itself, exposed the way Engine asks."""

    _contract: Contract

    @property
    def model(self) -> str:
        return self._contract.model

    @property
    def contract(self) -> Contract:
        return self._contract

    def room(self) -> int | None:
        """Items the engine wants claimed for it now; None: as many as the contract allows."""
        return None


@runtime_checkable
class Engine(Protocol):
    kind: str

    @property
    def model(self) -> str: ...

    @property
    def contract(self) -> Contract: ...

    def admit(self, batch: Batch, items: list[BatchItem]) -> list[Finished]:
        """Start prefills for ``items`` of ``batch``; returns items refused at once (too long)."""

    def step(self) -> list[Finished]:
        """One decode step over every active sequence; returns those that finished."""

    def active(self) -> int:
        """Sequences alive in the engine (admitted, not yet finished)."""

    def room(self) -> int | None:
        """How many items to claim for it now (0: none, None: no limit of its own). An engine that
        queues what it cannot run yet says how much more it wants, so the worker holds about one
        batch beyond what runs and the backlog stays in Redis."""

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        """Prepare for a shape before it is dispatched (graphs, prefix cache)."""

    def close(self) -> None: ...
