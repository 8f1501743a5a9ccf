"""Tests of mpt_keras.checks: the one message form of bad input."""

import json

import pytest

from mpt_keras.checks import check_choice, check_number
from mpt_keras.errors import UserInputError


@pytest.mark.parametrize(
    "value, options, message",
    [
        (0, {"minimum": 1, "integer": True}, "every: received 0. Allowed: an integer >= 1"),
        (1.5, {"minimum": 1, "integer": True}, "every: received 1.5. Allowed: an integer >= 1"),
        (True, {"integer": True}, "every: received True. Allowed: an integer"),
        (float("nan"), {}, "every: received nan. Allowed: a number"),
        (float("inf"), {"minimum": 0}, "every: received inf. Allowed: a number >= 0"),
        (0.0, {"above": 0, "maximum": 1}, "every: received 0.0. Allowed: a number > 0 and <= 1"),
        ("2", {}, "every: received '2'. Allowed: a number"),
        (
            float("-inf"),
            {"minimum": 0, "unbounded": True},
            "every: received -inf. Allowed: a number >= 0 (inf: no limit)",
        ),
    ],
)
def test_a_bad_number_is_refused_naming_what_and_the_range(value, options, message):
    with pytest.raises(UserInputError) as raised:
        check_number("every", value, **options)
    assert str(raised.value) == message


def test_a_good_number_is_returned_unchanged():
    assert check_number("every", 3, minimum=1, integer=True) == 3
    assert check_number("factor", 0.5, above=0, maximum=1) == 0.5
    assert check_number("max_kl", float("inf"), minimum=0, unbounded=True) == float("inf")


def test_a_choice_lists_what_is_allowed_and_shows_json_when_asked():
    assert check_choice("key 'strategy'", "auto", ("auto", "tpu")) == "auto"
    with pytest.raises(UserInputError) as raised:
        check_choice("key 'strategy'", "gpu", ("auto", "tpu"), show=json.dumps)
    assert str(raised.value) == "key 'strategy': received \"gpu\". Allowed: auto, tpu"
