"""gk.check, gk.check_between and gk.skip_check: the one-line checks every lesson's check cells use."""

import math

import pytest

import gpukit as gk


def test_a_check_that_holds_prints_one_line_saying_what_was_measured(capsys):
    gk.check(True, "the two clocks agree", "1.02")
    assert capsys.readouterr().out == "check passed: the two clocks agree (1.02)\n"


def test_a_check_that_fails_raises_an_assertion_error_with_the_claim_and_prints_nothing(capsys):
    with pytest.raises(AssertionError, match=r"^check failed: the two clocks agree \(2.04\)$"):
        gk.check(False, "the two clocks agree", "2.04")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("value", [0.5, 2.0, math.nan, math.inf, -math.inf])
def test_check_between_fails_a_value_twice_or_half_the_truth_and_any_non_finite_one(value):
    with pytest.raises(gk.CheckFailed, match="allowed 0.800 to 1.25"):
        gk.check_between(value, 0.8, 1.25, "gk.bench agrees with a hand clock")


@pytest.mark.parametrize("value", [0.8, 1.0, 1.25])
def test_check_between_passes_the_range_including_its_ends(value, capsys):
    gk.check_between(value, 0.8, 1.25, "gk.bench agrees with a hand clock", unit="x")
    assert capsys.readouterr().out.startswith(f"check passed: gk.bench agrees with a hand clock ({value:#.3g}x, ")


def test_check_between_refuses_a_range_given_upside_down():
    with pytest.raises(ValueError, match="lower end first"):
        gk.check_between(1.0, 1.25, 0.8, "anything")


def test_large_numbers_read_with_thousands_separators(capsys):
    gk.check_between(12345.6, 1000, 20000, "throughput", unit=" images/s")
    assert "12,346 images/s, allowed 1,000 images/s to 20,000 images/s" in capsys.readouterr().out


def test_skip_check_prints_the_line_the_site_counts_as_skipped(capsys):
    gk.skip_check("the bf16 count", "this GPU has no bf16")
    assert capsys.readouterr().out == "skipped: the bf16 count: this GPU has no bf16\n"


def test_a_whole_ratio_keeps_its_digits_so_a_line_keeps_its_shape(capsys):
    gk.check_between(1.0, 0.5, 2.0, "the ratio", unit="x")  # "1.00x", as 1.01 prints "1.01x"
    assert capsys.readouterr().out == "check passed: the ratio (1.00x, allowed 0.500x to 2.00x)\n"
