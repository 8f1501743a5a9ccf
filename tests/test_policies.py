"""Tests of mpt_keras.policies: the global policy scope and the precision report."""

import keras
import pytest

from mpt_keras import models
from mpt_keras.errors import UserInputError
from mpt_keras.policies import global_policy, precision_report


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
        "precision: unknown policy 'float16'. Allowed: float32, mixed_float16, mixed_bfloat16"
    )


def test_report_lists_every_layer_with_compute_and_variable_dtype():
    with global_policy("mixed_float16"):
        model = models.build_model("cnn", {}, input_shape=(8, 8, 1), num_classes=10)
    report = precision_report(model)
    assert report["model"] == "cnn"
    assert [entry["path"] for entry in report["layers"]] == [
        "conv_0",
        "pool_0",
        "conv_1",
        "pool_1",
        "flatten",
        "dense",
        "dropout",
        "logits",
    ]
    assert report["layers"][0] == {
        "path": "conv_0",
        "class": "Conv2D",
        "policy": "mixed_float16",
        "compute_dtype": "float16",
        "variable_dtype": "float32",
    }
    assert report["trainable_variables"] == {"float32": 8}
