"""Tests of mpt_keras.precision.names: the allowed names, checked without TensorFlow."""

import subprocess
import sys

import pytest

from mpt_keras.errors import UserInputError
from mpt_keras.precision.names import (
    COMPUTE_DTYPES,
    LOW_PRECISION_POLICIES,
    POLICY_NAMES,
    PRECISIONS,
    PROMOTIONS,
    check_policy_name,
)


def test_the_lists_agree():
    assert PRECISIONS == ("float32", "mixed_float16", "mixed_bfloat16", "auto")
    assert set(COMPUTE_DTYPES) == set(POLICY_NAMES)
    assert set(LOW_PRECISION_POLICIES) == set(PROMOTIONS) == set(POLICY_NAMES) - {"float32"}
    # Every step of the ladder widens the exponent or the mantissa, ending at float32.
    assert [COMPUTE_DTYPES[PROMOTIONS[name]] for name in LOW_PRECISION_POLICIES] == [
        "bfloat16",
        "float32",
    ]


def test_check_policy_name():
    assert check_policy_name("mixed_bfloat16") == "mixed_bfloat16"
    with pytest.raises(UserInputError) as raised:
        check_policy_name("auto", "rules[0].policy")
    assert str(raised.value) == (
        "rules[0].policy: received 'auto'. Allowed: float32, mixed_float16, mixed_bfloat16"
    )


def test_the_names_and_the_config_load_without_tensorflow_or_keras():
    code = (
        "import sys, mpt_keras.precision.names, mpt_keras.config\n"
        "print(sorted({'tensorflow', 'keras'} & {name.partition('.')[0] for name in sys.modules}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout == "[]\n"
