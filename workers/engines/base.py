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

    def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
        """Prepare for a shape before it is dispatched (graphs, prefix cache)."""

    def close(self) -> None: ...
