"""Checks of arguments, before any work: one wording for every "must be" error in the kit.

Each raises ValueError naming the argument, what it must be and what it got, with its type where
that is not a number (`clip="1.0"` says it got a str; a bool is not an integer here, although Python
says it is).
"""

from __future__ import annotations

import math

__all__ = ["check_int", "check_number", "is_int"]


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1, maximum: int | None = None, note: str = "") -> int:
    """`value` if it is an integer in [minimum, maximum]; `note` says what it counts, e.g. "(processes)"."""
    if is_int(value) and value >= minimum and (maximum is None or value <= maximum):
        return value
    if maximum is not None:
        wanted = f"an integer in {minimum}..{maximum}"
    else:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ValueError(f"{name} must be {wanted}{f' {note}' if note else ''}, got {_shown(value)}.")


def check_number(name: str, value, *, positive: bool = True, note: str = "") -> float:
    """`value` if it is a finite real number, > 0 with `positive` (else >= 0)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if number and (value > 0 if positive else value >= 0):
        return value
    wanted = "a positive number" if positive else "a number >= 0"
    raise ValueError(f"{name} must be {wanted}{f' {note}' if note else ''}, got {_shown(value)}.")


def _shown(value) -> str:
    """The value as written, and its type where that is not a number: `'1.0' (a str)`, `True (a bool)`."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return repr(value)
    return f"{value!r} (a {type(value).__name__})"
