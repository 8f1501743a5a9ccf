"""Tests of mpt_keras.reliability.auto_promote.AutoPromote, on either backend.

A promotion mid-fit reaches the next step compiled or not: on JAX the step jitted before it
kept float16 (a new `jax.jit` of the same step object ran its old trace), so the promoted
layers went on overflowing, silently.
"""

import json
import logging
import os

import keras
import numpy as np
import pytest

from mpt_keras import LossScaleOptimizer, PrecisionManifest, UserInputError
from mpt_keras.reliability.auto_promote import AutoPromote

STEPS = 12


def _overflowing_model(jit_compile="auto"):
    """first sums the inputs; big multiplies by 4e5: beyond float16's 65504."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(4, kernel_initializer="ones", name="first")(inputs)
    x = keras.layers.Dense(4, kernel_initializer=keras.initializers.Constant(1e5), name="big")(x)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(x))
    manifest = PrecisionManifest("mixed_float16")
    manifest.apply(model)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=4.0, min_scale=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model, manifest


def _fit(model, callbacks):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(16 * STEPS, 8)).astype("float32")
    labels = rng.integers(0, 3, 16 * STEPS)
    model.fit(features, labels, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=callbacks)  # fmt: skip


def test_without_it_every_step_overflows():
    model, _ = _overflowing_model()
    _fit(model, [])
    assert (model.optimizer.skipped_steps, model.optimizer.loss_scale) == (STEPS, 1.0)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_overflowing_layers_are_promoted_mid_fit_and_training_goes_on(
    tmp_path, caplog, jit_compile
):
    model, manifest = _overflowing_model(jit_compile)
    manifest_path = str(tmp_path / "promoted.json")
    promote = AutoPromote(
        manifest, k=3, check_every=2, manifest_path=manifest_path, log_dir=str(tmp_path / "logs")
    )
    before = [weight.copy() for weight in model.get_weights()]
    with caplog.at_level(logging.WARNING, logger="mpt_keras"):
        _fit(model, [promote])

    # Steps 1-4 overflow (scale 4 -> 2 -> 1, then at the floor); the check at
    # step 4 sees 4 non-finite steps >= k. The loss was inf, so every layer's
    # gradients were: logits, already float32, cannot go further.
    assert promote.promotions == [
        (4, "first", "mixed_float16", "mixed_bfloat16"),
        (4, "big", "mixed_float16", "mixed_bfloat16"),
    ]
    assert model.optimizer.skipped_steps == 4
    assert {layer.name: layer.dtype_policy.name for layer in model.layers[1:]} == {
        "first": "mixed_bfloat16",
        "big": "mixed_bfloat16",
        "logits": "float32",
    }
    after = model.get_weights()
    assert all(np.isfinite(weight).all() for weight in after)
    assert any(not np.array_equal(b, a) for b, a in zip(before, after))  # it trained
    reason = (
        "AutoPromote step 4: layer big mixed_float16 -> mixed_bfloat16: non-finite gradients "
        "on 4 steps at loss scale 1 (the floor)"
    )
    with open(manifest_path) as file:
        written = json.load(file)
    assert written["default"] == "mixed_float16"
    assert written["rules"][1] == {
        "match": {"path": "big"},
        "policy": "mixed_bfloat16",
        "reason": reason,
    }
    assert PrecisionManifest.from_dict(written) == promote.manifest
    assert reason in caplog.text
    assert "AutoPromote: layer logits keeps overflowing in float32" in caplog.text
    assert os.listdir(tmp_path / "logs" / "auto_promote")  # the TensorBoard text event


def test_a_healthy_run_promotes_nothing():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(inputs))
    manifest = PrecisionManifest("mixed_float16", safe_defaults=False)
    manifest.apply(model)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=4.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    promote = AutoPromote(manifest, k=1, check_every=1)
    _fit(model, [promote])
    assert (promote.promotions, model.optimizer.skipped_steps) == ([], 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"k": 0}, "AutoPromote k: received 0. Allowed: an integer >= 1"),
        ({"check_every": 1.5}, "AutoPromote check_every: received 1.5. Allowed: an integer >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(UserInputError) as raised:
        AutoPromote(PrecisionManifest("mixed_float16"), **kwargs)
    assert str(raised.value) == message


def test_another_optimizer_is_refused():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(UserInputError) as raised:
        model.fit(np.zeros((4, 8)), np.zeros((4, 3)), verbose=0,
                  callbacks=[AutoPromote(PrecisionManifest("float32"))])  # fmt: skip
    assert str(raised.value) == (
        "AutoPromote model.optimizer: received SGD. Allowed: mpt_keras.LossScaleOptimizer"
    )
