"""`calibrate` on either backend: the same model and data give the same figures and manifest.

On TensorFlow one taped pass gives the gradients; on JAX `jax.grad` through `stateless_call`,
with a zero added at each recorded matmul output (`calibration/measurement.py`). The figures
below hold on both to float32's rounding; the bfloat16 output error differs by backend (each
rounds its bfloat16 matmul its own way), so only its bound is pinned.
"""

import json

import keras
import numpy as np
import pytest

from mpt_keras import calibrate


@pytest.fixture(scope="module")
def statistics():
    keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    x = rng.normal(size=(64, 4)).astype("float32") * 3
    y = rng.integers(0, 3, 64).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    result = calibrate(
        model, (x, y), loss, steps=2, batch_size=16, seed=0, float8=True, float8_speed="ignore"
    )
    return json.loads(result.to_json()), json.loads(result.manifest.to_json())


def test_the_gradients_figures(statistics):
    gradients = statistics[0]["gradients"]
    assert {path: figures["max"] for path, figures in gradients.items()} == pytest.approx(
        {
            "hidden/bias": 1.152794,
            "hidden/kernel": 3.606278,
            "logits/bias": 0.3558033,
            "logits/kernel": 2.180617,
        },
        rel=1e-6,
    )
    assert gradients["hidden/kernel"]["overflow_fraction"] == 0.03125
    assert gradients["logits/kernel"]["norm"] == pytest.approx(6.369095, rel=1e-6)


def test_the_float8_figures_come_from_the_output_gradients(statistics):
    hidden, logits = (statistics[0]["float8_layers"][name] for name in ("hidden", "logits"))
    assert (hidden["calls"], logits["calls"]) == (2, 2)
    assert hidden["inputs"]["amax"] == pytest.approx(9.319011, rel=1e-6)
    assert hidden["outputs_grad"]["amax"] == pytest.approx(0.1818231, rel=1e-6)
    assert hidden["outputs_grad"]["underflowed"] == 0.08984375
    assert logits["outputs_grad"] == {
        "amax": 0.0625,
        "format": "e5m2",
        "saturated": 0.0,
        "underflowed": 0.09375,
    }
    assert hidden["reason"] == "output gradient underflows 8.98% in e5m2 > 1% -> not float8"


def test_the_decisions_and_the_manifest(statistics):
    hidden = statistics[0]["layers"]["hidden"]
    assert hidden["reason"] == "range fits float16, error 0.00043 <= 0.01 -> mixed_float16"
    assert hidden["errors"]["mixed_float16"] == pytest.approx(4.3138e-4, rel=1e-4)
    assert 0.002 < hidden["errors"]["mixed_bfloat16"] < 0.004
    assert hidden["activations"]["p99"] == pytest.approx(13.28457, rel=1e-6)
    assert statistics[1] == {
        "version": 1,
        "default": "mixed_float16",
        "safe_defaults": True,
        "rules": [],
    }
