"""Argument parsing for ``conductor``: value types that refuse bad values, a help formatter that
shows every default, and a parser whose errors are one line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import NoReturn

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class Parser(argparse.ArgumentParser):
    """argparse prints the whole usage block before an error; an operator reading a log or a
    script's stderr wants the one line that says what was wrong."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {_close_choice(message)} (see {self.prog} --help)\n")
        sys.exit(2)


def _close_choice(message: str) -> str:
    """argparse's "invalid choice: 'sumbit' (choose from ...)" with ``; did you mean 'submit'?`` in
    place of the whole list when a choice is close; the message as it was otherwise."""
    import re

    from conductor.errors import did_you_mean
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not m:
        return message
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    close = did_you_mean(m.group(1), choices)
    return message[:m.start()] + f"invalid choice: '{m.group(1)}'{close}" if close else message


class DefaultsFormatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` after every option that has one; flags (False) and options without a
    default (None, '', an empty list) say nothing, so the help shows only defaults that mean something."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default is argparse.SUPPRESS or action.default in (None, False, "") or \
                action.default == []:
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            return f"{text} (default: %(default)s)"
        return text


def _number(kind: type[int] | type[float], low: float | None, strict: bool, what: str) -> Callable[[str], int | float]:
    def parse(raw: str) -> int | float:
        try:
            value: int | float = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}") from None
        if kind is float and value != value:  # NaN passes every comparison
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}")
        if low is not None and (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"{raw!r} is not {what}")
        return value
    parse.__name__ = what  # argparse names the type in its message when the function raises ValueError
    return parse


positive_int = _number(int, 0, True, "a whole number of at least 1")
non_negative_int = _number(int, 0, False, "a whole number of at least 0")
positive_float = _number(float, 0, True, "a number above 0")
non_negative_float = _number(float, 0, False, "a number of at least 0")


def port(raw: str) -> int:
    """A TCP port, or BASE+N (a systemd template writes ``9500+%i``: one port per instance, valid
    for any instance number, where ``95%i0`` stops being a port at instance 10)."""
    try:
        value = sum(int(part) for part in raw.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a TCP port (1..65535, or BASE+N)") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a TCP port (1..65535, or BASE+N)")
    return value


def log_level(raw: str) -> int:
    name = raw.strip().lower()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a log level (one of {', '.join(LOG_LEVELS)})")
    level: int = getattr(logging, name.upper())
    return level
