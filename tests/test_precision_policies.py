"""Tests of mpt_keras.precision.policies: the global policy scope."""

import keras
import pytest

from mpt_keras.errors import UserInputError
from mpt_keras.precision.policies import global_policy


def test_global_policy_applies_inside_and_restores_after():
    with global_policy("mixed_bfloat16"):
        layer = keras.layers.Dense(2)
    assert layer.compute_dtype == "bfloat16"
    assert layer.variable_dtype == "float32"
    assert keras.config.dtype_policy().name == "float32"


def test_global_policy_restores_on_error():
    with pytest.raises(RuntimeError):
        with global_policy("mixed_float16"):
            raise RuntimeError
    assert keras.config.dtype_policy().name == "float32"


def test_unknown_policy():
    with pytest.raises(UserInputError) as raised:
        with global_policy("float16"):
            pass
    assert str(raised.value) == (
        "precision: received 'float16'. Allowed: float32, mixed_float16, mixed_bfloat16"
    )
