"""Calibration recommends float8 only where it pays: the GEMM timed on a float8 device, never on
a CPU. The timings here are given (a device's, not this machine's): what is tested is the rule
and its reasons, not a speed."""

import numpy as np
import pytest
import tensorflow as tf

from mpt_keras.calibration.calibrate import calibrate
from mpt_keras.calibration.float8_speed import SpeedJudge
from mpt_keras.errors import UserInputError
from mpt_keras.precision.hardware import HardwareProbe

HOPPER = HardwareProbe(gpu_compute_capabilities=((9, 0),))
FEATURES = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")


def _model():
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, name="wide")(inputs)
    hidden = keras.layers.Dense(4, name="narrow")(hidden)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))


def _output_as_loss(y_true, y_pred):
    return y_pred


def _calibrate(**options):
    data = tf.data.Dataset.from_tensor_slices((FEATURES, np.zeros(8))).batch(4)
    return calibrate(_model(), data, _output_as_loss, steps=2, float8=True, **options)


def test_a_timed_shape_pays_only_above_the_minimum_speedup():
    timings = {(4, 16, 32): (3.0, 2.0), (4, 32, 4): (1.0, 2.0)}
    timed = []

    def timer(shape, dtype):
        timed.append((shape, dtype))
        return timings[shape]

    judge = SpeedJudge("bfloat16", 1.2, probe=HOPPER, timer=timer)
    fast, slow = judge.judge((4, 16, 32)), judge.judge((4, 32, 4))
    assert (fast.speedup, fast.pays) == (1.5, True)
    assert fast.reason == "float8 GEMMs 1.50x bfloat16 at 4x16x32 (measured here, needs >= 1.2x)"
    assert (slow.speedup, slow.pays) == (0.5, False)
    assert judge.judge((4, 16, 32)) is fast
    assert timed == [((4, 16, 32), "bfloat16"), ((4, 32, 4), "bfloat16")]  # Each shape once.


def test_without_float8_gemms_nothing_is_timed_and_nothing_pays():
    def timer(shape, dtype):
        raise AssertionError("timed on a device without float8 GEMMs")

    verdict = SpeedJudge("bfloat16", 1.0, probe=HardwareProbe(), timer=timer).judge((4, 16, 32))
    assert (verdict.speedup, verdict.pays) == (None, False)
    assert verdict.reason == (
        "no float8 GEMMs here (no GPU: this machine has no float8 matmul units): emulated, "
        "cannot pay"
    )


def test_on_a_cpu_measure_refuses_each_layer_with_the_reason(monkeypatch):
    result = _calibrate()  # float8_speed="measure" is the default.
    layers = result.statistics["float8_layers"]
    assert {path: layer["gemm"] for path, layer in layers.items()} == {
        "wide": [4, 16, 32],
        "narrow": [4, 32, 4],
        "head": [4, 4, 1],
    }
    for layer in (layers["wide"], layers["narrow"]):  # The head stays float32 anyway.
        assert layer["recommended"] is False
        assert layer["reason"].endswith(
            "no float8 GEMMs here (no GPU: this machine has no float8 matmul units): emulated, "
            "cannot pay -> not float8"
        )
    assert "float8" not in {rule.policy for rule in result.manifest.rules}


def test_a_measured_speed_decides_and_shows_in_the_reason(monkeypatch):
    monkeypatch.setattr("mpt_keras.calibration.float8_speed.probe_hardware", lambda: HOPPER)
    seconds = {(4, 16, 32): (2.0, 1.0), (4, 32, 4): (1.0, 4.0)}
    monkeypatch.setattr(
        "mpt_keras.calibration.float8_speed.gemm_seconds", lambda shape, dtype: seconds[shape]
    )
    layers = _calibrate().statistics["float8_layers"]
    numbers = layers["wide"]["reason"].rpartition("; float8 GEMMs")[0]
    assert layers["wide"]["reason"] == (
        f"{numbers}; float8 GEMMs 2.00x float16 at 4x16x32 (measured here, needs >= 1x) -> float8"
    )
    assert layers["narrow"]["reason"].endswith(
        "float8 GEMMs 0.25x float16 at 4x32x4 (measured here, needs >= 1x) -> not float8"
    )
    assert [layers[path]["recommended"] for path in ("wide", "narrow")] == [True, False]


def test_ignore_decides_by_the_numbers_alone():
    layers = _calibrate(float8_speed="ignore").statistics["float8_layers"]
    assert all("float8 GEMMs" not in layer["reason"] for layer in layers.values())
    assert layers["wide"]["recommended"] is True


def test_an_unknown_float8_speed_is_refused():
    with pytest.raises(UserInputError, match="float8_speed"):
        _calibrate(float8_speed="guess")
