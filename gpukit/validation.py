"""Checks of arguments, before any work: one wording for every "must be" error in the kit.

Each raises ValueError naming the argument, what it must be and what it got, with its type where
that is not a number (`clip="1.0"` says it got a str; a bool is not an integer here, although Python
says it is).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["SEED_RANGE", "check_int", "check_number", "check_seed", "is_int"]

# Seeds every generator a run seeds accepts: NumPy's np.random.seed takes 0..2**32-1 (gk.seed_everything and
# `gpukit train --seed` seed it); torch takes up to 2**64-1, which fit's derived seeds (seed + rank, a device loader's
# seed × 1,000,003 + epoch) would pass from 2**44 on, in the middle of a run.
SEED_RANGE = (0, 2**32 - 1)


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


def check_seed(seed, name: str = "seed") -> int:
    """`seed` as a Python int if it is an integer (Python's or NumPy's, not a bool) in SEED_RANGE: the one check of
    every seed in the kit, so that a seed one function takes no other refuses."""
    low, high = SEED_RANGE
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and low <= seed <= high:
        return int(seed)
    raise ValueError(
        f"{name} must be an integer in {low}..{high} (2**32 - 1: the range NumPy's generator takes, and every seed "
        f"derived from it stays in torch's), got {_shown(seed)}."
    )


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
