"""The one wording of "must be" errors (gpukit.validation), used by every argument check in the kit."""

import math
import re

import pytest

from gpukit.validation import check_int, check_number, is_int


@pytest.mark.parametrize(
    "value, shown",
    [(True, "True (a bool)"), (1.0, "1.0"), ("3", "'3' (a str)"), (None, "None"), (0, "0"), (-2, "-2")],
)
def test_check_int_refuses_what_is_not_a_positive_integer(value, shown):
    with pytest.raises(ValueError, match=rf"batch_size must be a positive integer, got {re.escape(shown)}\.$"):
        check_int("batch_size", value)


def test_check_int_bounds_and_notes():
    assert check_int("epochs", 0, minimum=0) == 0 and check_int("port", 65535, maximum=65535) == 65535
    with pytest.raises(ValueError, match=r"port must be an integer in 1\.\.65535, got 70000\."):
        check_int("port", 70_000, maximum=65535)
    with pytest.raises(ValueError, match=r"steps must be an integer >= 5 \(optimizer steps\), got 4\."):
        check_int("steps", 4, minimum=5, note="(optimizer steps)")
    assert is_int(3) and not is_int(True) and not is_int(3.0)


@pytest.mark.parametrize("value", [0, -1.5, math.nan, math.inf, True, "0.1"])
def test_check_number_refuses_what_is_not_a_finite_positive_number(value):
    with pytest.raises(ValueError, match="lr must be a positive number"):
        check_number("lr", value)


@pytest.mark.parametrize("value, shown", [("1.0", "'1.0' (a str)"), ([1], "[1] (a list)"), (math.nan, "nan")])
def test_check_number_names_the_type_of_what_is_not_a_number(value, shown):
    with pytest.raises(ValueError, match=rf"clip must be a positive number, got {re.escape(shown)}\.$"):
        check_number("clip", value)


def test_check_number_may_allow_zero():
    assert check_number("weight", 0, positive=False) == 0 and check_number("lr", 0.1) == 0.1
    with pytest.raises(ValueError, match=r"weight must be a number >= 0 \(grams\), got -1\."):
        check_number("weight", -1, positive=False, note="(grams)")
