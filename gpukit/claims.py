"""A lesson's checks: each claim tested where it is made, in one plain line.

A lesson's check cell compares two things measured apart, or a measurement with a bound derived from the data, and
says what it found in one line:

    gk.check_between(counted / by_hand, 0.9, 1.1, "the FLOP counter agrees with a count by hand")
    # check passed: the FLOP counter agrees with a count by hand (1.012, allowed 0.900 to 1.100)

A check that fails raises `CheckFailed` (an `AssertionError`, so nbval and pytest report it as a failed assert) with
the same line. A check this machine cannot make says so with `skip_check`, whose line starts "skipped": the lessons'
site counts these lines, so a cell whose every check was skipped never shows as checked.
"""

from __future__ import annotations

import math

__all__ = ["CheckFailed", "check", "check_between", "skip_check"]


class CheckFailed(AssertionError):
    """A lesson's claim did not hold on this machine: the message says what was measured against what."""


def check(condition: bool, claim: str, measured: str = "") -> None:
    """Print "check passed: CLAIM (MEASURED)" if `condition` holds, else raise CheckFailed with the same words."""
    detail = f" ({measured})" if measured else ""
    if not condition:
        raise CheckFailed(f"check failed: {claim}{detail}")
    print(f"check passed: {claim}{detail}")


def check_between(value: float, low: float, high: float, claim: str, unit: str = "") -> None:
    """Check `low <= value <= high`, both sides: a measurement 2x off in either direction should leave the range.

    A NaN or infinite value always fails. `unit` is printed after each number ("x", " s", " GiB").
    """
    if not low <= high:
        raise ValueError(f"check_between: low ({low}) is above high ({high}); give the range's lower end first")
    shown = f"{_number(value)}{unit}, allowed {_number(low)}{unit} to {_number(high)}{unit}"
    check(math.isfinite(value) and low <= value <= high, claim, shown)


def skip_check(claim: str, why: str) -> None:
    """Say that this machine cannot make a check, and why (a line starting "skipped", as the site counts them)."""
    print(f"skipped: {claim}: {why}")


def _number(value: float) -> str:
    """Three significant digits, trailing zeros kept ("1.00", not "1"), so that a line's shape does not change with
    its value (strict nbval masks the digits, not their count); thousands separated from 1,000 up."""
    if math.isfinite(value) and 1000 <= abs(value) < 1e9:
        return f"{value:,.0f}"
    return f"{value:#.3g}" if math.isfinite(value) else f"{value}"
