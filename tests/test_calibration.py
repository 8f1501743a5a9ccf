"""Tests of mpt_keras.calibration: statistics, decisions with reasons, the manifest."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpt_keras import PrecisionManifest, Rule, UserInputError
from mpt_keras.calibration import CalibrationThresholds, calibrate

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Times(keras.layers.Layer):
    """Multiplies by a constant: an engineered range problem without a Lambda."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, inputs):
        return inputs * self.factor


class Block(keras.layers.Layer):
    """A nested unit: Dense then LayerNormalization, scaled by `factor`."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor
        self.inner = keras.layers.Dense(4, name="inner", dtype=self.dtype_policy)
        self.norm = keras.layers.LayerNormalization(name="norm", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.norm.build(input_shape[:-1] + (4,))

    def call(self, inputs):
        return self.norm(self.inner(inputs)) * self.factor


def _data(examples=64, features=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(examples, features)).astype("float32"),
        rng.integers(0, 3, examples),
    )


def _model(*middle):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, kernel_initializer="ones", name="first")(inputs)
    for layer in middle:
        x = layer(x)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))


def test_a_layer_beyond_the_float16_range_gets_bfloat16_with_the_range_as_reason():
    model = _model(
        keras.layers.Dense(4, kernel_initializer="ones", name="hidden"), Times(1e5, name="big")
    )
    features, labels = _data()
    result = calibrate(model, (features, labels), LOSS, steps=2, batch_size=32)

    layers = result.statistics["layers"]
    # Every example is used once (64 = 2 x 32): first sums the 4 features,
    # hidden sums the 4 equal sums, big multiplies by 1e5.
    expected_max = float(np.max(np.abs(features.sum(axis=1) * 4 * 1e5)))
    assert layers["big"]["activations"]["max"] == pytest.approx(expected_max, rel=1e-6)
    assert layers["big"]["activations"]["above_float16_max_fraction"] == pytest.approx(
        np.mean(np.abs(features.sum(axis=1) * 4 * 1e5) > 65504), abs=1e-9
    )
    assert layers["big"]["errors"]["mixed_float16"] is None  # inf in float16
    assert layers["big"]["errors"]["mixed_bfloat16"] < 5e-3
    assert layers["big"]["reason"] == (
        f"activation max {expected_max:.3g} > 8188 (float16 max 65504 / headroom 8) "
        "-> mixed_bfloat16"
    )
    assert {path: layer["policy"] for path, layer in layers.items()} == {
        "first": "mixed_float16",
        "hidden": "mixed_float16",
        "big": "mixed_bfloat16",
        "logits": "float32",
    }
    assert layers["logits"]["reason"] == "safe default: model output"
    assert result.manifest == PrecisionManifest(
        "mixed_float16", (Rule("mixed_bfloat16", path="big", reason=layers["big"]["reason"]),)
    )
    assert result.manifest.apply(model).policies == {
        "first": "mixed_float16",
        "hidden": "mixed_float16",
        "big": "mixed_bfloat16",
        "logits": "float32",
    }


@pytest.mark.parametrize(
    "initial_scale, underflow_fraction, policy",
    [(2.0**15, 1.0, "mixed_bfloat16"), (2.0**40, 0.0, "mixed_float16")],
)
def test_gradients_that_underflow_float16_at_the_initial_scale_are_flagged(
    initial_scale, underflow_fraction, policy
):
    # Inputs of ~1e-12 make tiny_grad's kernel gradients ~1e-14; its output
    # (bias 1) stays in range, so only the gradients can flag it.
    model = _model(
        Times(1e-12, name="shrink"),
        keras.layers.Dense(4, bias_initializer="ones", name="tiny_grad"),
    )
    result = calibrate(model, _data(), LOSS, steps=2, initial_scale=initial_scale)

    gradients = result.statistics["gradients"]["tiny_grad/kernel"]
    assert gradients["layer"] == "tiny_grad"
    assert gradients["underflow_fraction"] == underflow_fraction
    assert gradients["overflow_fraction"] == 0.0
    assert result.statistics["gradients"]["tiny_grad/bias"]["underflow_fraction"] == 0.0
    tiny_grad = result.statistics["layers"]["tiny_grad"]
    assert tiny_grad["policy"] == policy
    if policy == "mixed_bfloat16":
        assert tiny_grad["reason"] == (
            "100.0% of tiny_grad/kernel gradients x 32768 < float16 subnormal min 6e-08 "
            "(> 1.0%) -> mixed_bfloat16"
        )
    shrink = result.statistics["layers"]["shrink"]
    assert shrink["activations"]["below_subnormal_fraction"] == 1.0
    assert shrink["reason"].startswith("100.0% of activations < float16 subnormal min 6e-08")


def test_too_large_errors_in_both_low_precisions_give_float32():
    model = _model(keras.layers.Dense(4, name="hidden"))
    thresholds = CalibrationThresholds(max_float16_error=1e-9, max_bfloat16_error=1e-9)
    layers = calibrate(model, _data(), LOSS, steps=1, thresholds=thresholds).statistics["layers"]

    error16 = layers["hidden"]["errors"]["mixed_float16"]
    error_b16 = layers["hidden"]["errors"]["mixed_bfloat16"]
    assert 1e-5 < error16 < error_b16 < 1e-2  # bfloat16 rounds 8x coarser
    assert layers["hidden"]["reason"] == (
        f"float16 error {error16:.2g} > 1e-09; bfloat16 error {error_b16:.2g} > 1e-09 -> float32"
    )


def test_a_nested_unit_gets_rules_for_its_sublayers_but_not_its_normalization():
    model = _model(Block(1e5, name="block"))
    result = calibrate(model, _data(), LOSS, steps=1)

    reason = result.statistics["layers"]["block"]["reason"]
    assert reason.endswith("(float16 max 65504 / headroom 8) -> mixed_bfloat16")
    assert result.manifest.rules == (
        Rule("mixed_bfloat16", path="block", reason=reason),
        Rule("mixed_bfloat16", path="block/inner", reason="follows block"),
    )
    assert result.manifest.apply(model).policies == {
        "first": "mixed_float16",
        "block": "mixed_bfloat16",
        "block/inner": "mixed_bfloat16",
        "block/norm": "float32",
        "logits": "float32",
    }


def test_same_data_and_seed_give_identical_statistics():
    model = _model(keras.layers.Dense(4, name="hidden"))
    data = _data()
    first = calibrate(model, data, LOSS, steps=2, batch_size=16, seed=3)
    second = calibrate(model, data, LOSS, steps=2, batch_size=16, seed=3)
    other_seed = calibrate(model, data, LOSS, steps=2, batch_size=16, seed=4)

    assert first.to_json() == second.to_json()
    assert first.manifest == second.manifest
    assert first.statistics["layers"] != other_seed.statistics["layers"]
    json.loads(first.to_json())  # strict JSON: no NaN or Infinity


def test_a_dataset_is_read_for_steps_batches():
    model = _model(keras.layers.Dense(4, name="hidden"))
    features, labels = _data()
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(16)
    from_dataset = calibrate(model, dataset, LOSS, steps=2)
    # The same 32 examples as arrays in the same order give the same figures.
    first_32 = calibrate(model, (features[:32], labels[:32]), LOSS, steps=1, batch_size=32)

    assert from_dataset.statistics["steps"] == 2
    assert from_dataset.statistics["layers"]["hidden"]["activations"]["max"] == pytest.approx(
        first_32.statistics["layers"]["hidden"]["activations"]["max"]
    )


def test_policies_and_weights_are_restored():
    model = _model(keras.layers.Dense(4, name="hidden"))
    PrecisionManifest("mixed_bfloat16").apply(model)
    weights = [w.copy() for w in model.get_weights()]
    calibrate(model, _data(), LOSS, steps=1)

    assert {layer.name: layer.dtype_policy.name for layer in model.layers[1:]} == {
        "first": "mixed_bfloat16",
        "hidden": "mixed_bfloat16",
        "logits": "float32",
    }
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.dense = keras.layers.Dense(3)

    def call(self, inputs):
        return self.dense(inputs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "steps: must be an integer >= 1, received 0"),
        ({"initial_scale": -1.0}, "initial_scale: must be a number > 0, received -1.0"),
        ({"batch_size": 0}, "batch_size: must be an integer >= 1, received 0"),
        (
            {"data": [1, 2]},
            "data: received list. Allowed: a tf.data.Dataset of (x, y) batches or a tuple "
            "(x, y) of arrays",
        ),
        (
            {"data": (np.zeros((3, 4)), np.zeros(2))},
            "data: received 3 examples and 2 labels. Allowed: as many labels as examples, "
            "at least one",
        ),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    model = _model()
    arguments = {"data": _data(), "loss": LOSS, **kwargs}
    with pytest.raises(UserInputError) as raised:
        calibrate(model, **arguments)
    assert str(raised.value) == message


def test_a_subclassed_model_is_refused():
    model = _Subclassed()
    model(np.zeros((1, 4), "float32"))
    with pytest.raises(UserInputError) as raised:
        calibrate(model, _data(), LOSS)
    assert str(raised.value) == (
        "model 'subclassed': _Subclassed has no graph of layer outputs (subclassed, or not "
        "built). Allowed: a built functional or Sequential model"
    )


def test_bad_thresholds_are_one_line_errors():
    with pytest.raises(UserInputError) as raised:
        CalibrationThresholds(max_float16_error=0)
    assert str(raised.value) == (
        "CalibrationThresholds.max_float16_error: must be a number > 0, received 0"
    )
    with pytest.raises(UserInputError) as raised:
        CalibrationThresholds(float16_headroom=0.5)
    assert str(raised.value) == "CalibrationThresholds.float16_headroom: must be >= 1, received 0.5"
