"""Typed errors the conductor raises to its callers."""

from __future__ import annotations


class ConductorError(Exception):
    """Base class of every error the conductor raises on purpose."""


def did_you_mean(name: str, known: list[str]) -> str:
    """``; did you mean 'demo-7b'?`` when a known name is close to ``name``, else ''."""
    import difflib
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""


class BadInput(ConductorError):
    """An item or argument that the conductor refuses; names the field (and line, if any)."""

    def __init__(self, field: str, message: str, line: int | None = None) -> None:
        self.field = field
        self.line = line
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{field}: {message}")


class NoSuchModel(BadInput):
    """A line naming a model Redis does not know (a typo, or a model no worker serves yet)."""


class DuplicateId(BadInput):
    """An item id the job already has, or is given twice, under another model: an id names one
    item of a job, across all its models (one id, one result)."""

    def __init__(self, item_id: str, message: str, line: int | None = None) -> None:
        self.item_id = item_id
        self.detail = message
        super().__init__("id", message, line)


class QueueFull(ConductorError):
    """Backpressure: the model's waiting-token ceiling or Redis maxmemory refused the submit.

    Nothing of the refused call was written; items accepted before it stay accepted, and a
    re-run of the same job skips them (submission is idempotent on the item id). ``waiting``:
    the tokens the model's queue held when it refused (None when Redis memory refused).
    """

    def __init__(self, message: str, waiting: int | None = None) -> None:
        self.waiting = waiting
        super().__init__(message)


class UnknownModel(ConductorError):
    """No live registered worker serves the model a RequestClient was made for; ``served``
    names the models that live workers do serve."""

    def __init__(self, model: str, served: list[str]) -> None:
        self.model = model
        self.served = served
        super().__init__(f"no live worker serves model {model!r}; models served now: "
                         f"{', '.join(served) if served else 'none'}")


class RequestTimeout(ConductorError):
    """A request got no permit, or no result, within its timeout. Its item, if submitted, stays
    queued and is run (a request is an item like any other); its late result is not delivered."""


class ClientClosed(ConductorError):
    """The RequestClient was closed: before this request, or while it waited."""


class Paused(ConductorError):
    """The model is paused (``conductor pause``): nothing of the refused call was written; the
    same call succeeds after ``conductor resume``."""


class Conflict(ConductorError):
    """A re-submit under an existing job brought ids the job already has with other content:
    another file under a reused job name, whose old results a reader would take for its own.
    Nothing of the refused call was written."""


class NotReplicated(ConductorError):
    """The write went to the primary, but fewer replicas than asked for confirmed it in time
    (WAIT). Sending the same call again is safe: submit and complete are idempotent."""


class SchemaMismatch(ConductorError):
    """Redis holds a key layout this code does not know: run ``conductor migrate``."""


class RedisUnavailable(ConductorError):
    """Redis could not be reached (wrong URL, server down, TLS or auth failure)."""
