"""A model's own `train_step`, written as Keras' guides write it, under our loss scaling.

Keras' "Customizing what happens in fit()" guides take gradients of `compute_loss` and call
`optimizer.apply` (TensorFlow) or `optimizer.stateless_apply` (JAX) without `scale_loss`.
With float16 layers `model.compile` wraps the optimizer in a loss-scale optimizer, whose
`apply` divides by the scale gradients that were never scaled: Keras' stock class trains
32768 times slower, silently. Ours applies them as they are and warns once. Runs on both
backends (tests/test_jax_backend.py runs this file on JAX).
"""

from __future__ import annotations

import contextlib
import logging

import keras
import numpy as np
import pytest

from mpt_keras.scaling.optimizer import LossScaleOptimizer

BACKEND = keras.backend.backend()
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(32, 8)).astype("float32")
Y = (X @ _RNG.normal(size=(8, 1))).astype("float32")


class GuideStep(keras.Model):
    """The guides' custom step; `scales` adds the one line Keras' own step has, `unscales`
    the tf-keras one after it (`get_unscaled_gradients`); on JAX, `mapped=False` reads the
    optimizer's variables outside a `keras.StatelessScope` of the step's values."""

    def __init__(self, *args, scales=False, unscales=False, mapped=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.scales, self.unscales, self.mapped = scales or unscales, unscales, mapped

    def _loss(self, y, y_pred):
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return self.optimizer.scale_loss(loss) if self.scales else loss

    def _unscaled(self, grads):
        return self.optimizer.get_unscaled_gradients(grads) if self.unscales else grads

    if BACKEND == "tensorflow":

        def train_step(self, data):
            import tensorflow as tf

            x, y = data
            with tf.GradientTape() as tape:
                loss = self._loss(y, self(x, training=True))
            grads = self._unscaled(tape.gradient(loss, self.trainable_variables))
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    else:

        def _loss_and_updates(self, trainable, non_trainable, optimizer_values, x, y):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            with self._optimizer_values(optimizer_values):
                return self._loss(y, y_pred), non_trainable

        def _optimizer_values(self, optimizer_values):
            if not self.mapped:
                return contextlib.nullcontext()
            mapping = list(zip(self.optimizer.variables, optimizer_values))
            return keras.StatelessScope(state_mapping=mapping)

        def train_step(self, state, data):
            import jax

            trainable, non_trainable, optimizer_values, metrics = state
            x, y = data
            gradient = jax.value_and_grad(self._loss_and_updates, has_aux=True)
            (loss, non_trainable), grads = gradient(
                trainable, non_trainable, optimizer_values, x, y
            )
            with self._optimizer_values(optimizer_values):
                grads = self._unscaled(grads)
            trainable, optimizer_values = self.optimizer.stateless_apply(
                optimizer_values, grads, trainable
            )
            return {"loss": loss}, (trainable, non_trainable, optimizer_values, metrics)


class OwnLoss(keras.Model):
    """JAX: Keras' own train step, around a `compute_loss_and_updates` that never scales."""

    def compute_loss_and_updates(
        self, trainable, non_trainable, metrics, x, y, sample_weight, training=False, **_
    ):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=training)
        loss = keras.ops.mean(keras.ops.square(y - y_pred))
        return loss, (loss, y_pred, non_trainable, metrics)


def _trained(optimizer, model_class: type = GuideStep, **options) -> keras.Model:
    """Two SGD steps of a model whose hidden layer computes in float16."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", dtype="mixed_float16")(inputs)
    model = model_class(inputs, keras.layers.Dense(1)(hidden), name="guide", **options)
    # Traced either way: JAX's jitted step, as Keras runs it; a tf.function (XLA adds nothing).
    jit = BACKEND == "jax"
    model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False, jit_compile=jit)
    model.fit(X, Y, batch_size=16, verbose=0, shuffle=False)
    return model


@pytest.fixture(scope="module")
def plain() -> list[np.ndarray]:
    """The weights the inner optimizer alone reaches."""
    return _trained(keras.optimizers.SGD(0.1)).get_weights()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "never scaled" in r.getMessage()]


def test_a_step_that_never_scales_its_loss_trains_as_the_inner_optimizer_and_warns_once(
    plain, caplog
):
    with caplog.at_level(logging.WARNING):
        scaled = _trained(LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    for a, b in zip(plain, scaled.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _warnings(caplog) == [
        "model 'guide': its train_step applied gradients of a loss it never scaled (no "
        "optimizer.scale_loss(loss) before taking them): LossScaleOptimizer applies them as "
        "they are, not divided by the loss scale, so small float16 gradients may underflow to "
        "zero. Scale the loss before taking gradients, as Keras' own train_step does: loss = "
        "self.optimizer.scale_loss(loss)"
    ]
    assert (scaled.optimizer.skipped_steps, scaled.optimizer.loss_scale) == (0, 32768.0)


@pytest.mark.parametrize("unscales", [False, True], ids=["apply_unscales", "step_unscales"])
def test_a_step_that_scales_its_loss_is_unscaled_once_and_not_warned(plain, caplog, unscales):
    """Unscaled by `apply`, as Keras' own step; or by the step's `get_unscaled_gradients`
    (tf-keras' way), after which `apply` (`stateless_apply` on JAX) divides no more."""
    with caplog.at_level(logging.WARNING):
        # A scale under which no float16 gradient overflows: no step is skipped.
        optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=256)
        scaled = _trained(optimizer, scales=True, unscales=unscales)
    for a, b in zip(plain, scaled.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)  # float16 rounding of scaled
    assert _warnings(caplog) == []
    assert optimizer.skipped_steps == 0


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's stateless train step")
def test_a_jax_step_reading_the_scale_outside_its_optimizer_values_is_told_how():
    """fit sets the variables' own values aside: read there, the scale has none (Keras' own
    error is "'NoneType' object is not callable")."""
    with pytest.raises(ValueError) as raised:
        _trained(LossScaleOptimizer(keras.optimizers.SGD(0.1)), scales=True, mapped=False)
    assert str(raised.value) == _UNMAPPED.format("scale_loss")
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build([keras.Variable(np.zeros(2, "float32"))])
    with optimizer.model_train_step("guide"), pytest.raises(ValueError) as raised:
        optimizer.get_unscaled_gradients([keras.ops.ones(2)])
    assert str(raised.value) == _UNMAPPED.format("get_unscaled_gradients")


_UNMAPPED = (
    "model 'guide': its train_step called optimizer.{}() outside a keras.StatelessScope of the "
    "step's optimizer variables, where on JAX the loss scale has no value. Call it inside "
    "`with keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, "
    "optimizer_variables))):`, as Keras' own compute_loss_and_updates does"
)


@pytest.mark.skipif(BACKEND != "jax", reason="Keras' JAX trainer's compute_loss_and_updates")
def test_keras_jax_step_around_a_loss_never_scaled_trains_as_the_inner_optimizer(plain, caplog):
    with caplog.at_level(logging.WARNING):
        scaled = _trained(LossScaleOptimizer(keras.optimizers.SGD(0.1)), model_class=OwnLoss)
    for a, b in zip(plain, scaled.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("scales", [False, True], ids=["never_scaled", "scaled"])
def test_outside_a_models_step_apply_divides_as_keras_stock_class(scales):
    """A custom loop's `apply` (no model step around it) keeps the stock contract: it divides."""
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(1.0))
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer.build([variable])
    if scales:
        optimizer.scale_loss(1.0)
    optimizer.apply([keras.ops.convert_to_tensor([32768.0, 65536.0])], [variable])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), [-1.0, -2.0])
