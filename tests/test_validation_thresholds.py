"""Tests of mpt_keras.validation.thresholds: what a candidate must meet, and each check."""

import math

import pytest

import mpt_keras
from mpt_keras.validation.thresholds import Check, Thresholds


@pytest.mark.parametrize(
    "check, passed",
    [
        (Check("a", 0.5, 0.5, "<="), True),
        (Check("a", 0.6, 0.5, "<="), False),
        (Check("a", 0.5, 0.5, ">="), True),
        (Check("a", 0.4, 0.5, ">="), False),
        (Check("a", math.nan, 0.5, "<="), False),
        (Check("a", math.nan, 0.5, ">="), False),
    ],
)
def test_check_verdicts(check, passed):
    assert check.passed is passed


def test_check_describes_itself_in_one_line():
    check = Check("output_relative_error", 0.0123, 0.01, "<=")
    assert check.describe() == "output_relative_error: 0.0123 (allowed <= 0.01) FAIL"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"output_rtol": -1.0},
            "threshold output_rtol: received -1.0. Allowed: a number >= 0 (inf: no limit)",
        ),
        (
            {"max_kl": "big"},
            "threshold max_kl: received 'big'. Allowed: a number >= 0 (inf: no limit)",
        ),
        (
            {"max_kl": float("nan")},
            "threshold max_kl: received nan. Allowed: a number >= 0 (inf: no limit)",
        ),
        (
            {"min_top1_agreement": 2.0},
            "threshold min_top1_agreement: received 2.0. Allowed: a number >= 0 and <= 1",
        ),
    ],
)
def test_bad_thresholds_are_user_errors(kwargs, message):
    with pytest.raises(mpt_keras.UserInputError) as error:
        Thresholds(**kwargs)
    assert str(error.value) == message


def test_an_infinite_threshold_switches_its_check_off():
    thresholds = Thresholds(max_kl=float("inf"), max_loss_gap=float("inf"))
    assert thresholds.max_kl == float("inf")
