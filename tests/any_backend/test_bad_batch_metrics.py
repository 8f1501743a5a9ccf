"""A batch skipped as bad data counts in neither the loss nor any metric of `model.fit`.

Run on TensorFlow here and on JAX by `tests/test_jax_backend.py`: Keras' own train step, with
and without XLA, in float32 (conftest's default). The reference trains on the good batches
only: skipping the bad one leaves the weights as they were, so each good batch sees the same
weights in both runs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from mpt_keras.scaling.optimizer import LossScaleOptimizer

BACKEND = keras.backend.backend()


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three batches of 4, the second with a NaN input; and which rows are good."""
    rng = np.random.RandomState(7)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32")
    x[5, 2] = np.nan
    good = np.r_[0:4, 8:12]
    return x, y, good


def _fit(
    x: np.ndarray,
    y: np.ndarray,
    jit_compile: bool,
    epochs: int = 1,
    stock: bool = False,
    model_class: type[keras.Sequential] = keras.Sequential,
    metrics: tuple[str, ...] = ("mae",),
) -> tuple[dict[str, list[float]], keras.optimizers.LossScaleOptimizer]:
    model = model_class([keras.Input((3,)), keras.layers.Dense(1)])
    rng = np.random.RandomState(0)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    wrapper = keras.optimizers.LossScaleOptimizer if stock else LossScaleOptimizer
    opt = wrapper(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse", metrics=list(metrics) or None, jit_compile=jit_compile)
    history = model.fit(
        x,
        y,
        batch_size=4,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN()],
    )
    return history.history, opt


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_skipped_bad_batch_counts_in_no_metric(jit_compile):
    x, y, good = _data()
    history, opt = _fit(x, y, jit_compile)
    reference, reference_opt = _fit(x[good], y[good], jit_compile)
    assert (opt.bad_batches, reference_opt.bad_batches) == (1, 0)
    assert history["skipped_steps"] == [1.0]
    for name in ("loss", "mae"):
        assert np.isfinite(history[name]).all(), name
        np.testing.assert_allclose(history[name], reference[name], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(history["loss"], [7.706347], rtol=1e-5)


def test_terminate_on_nan_trains_on_past_a_skipped_bad_batch():
    """Its loss, a NaN, would stop the run at the bad batch: the batch's logs leave it out."""
    x, y, _ = _data()
    history, opt = _fit(x, y, jit_compile=True, epochs=3)
    assert len(history["loss"]) == 3
    assert opt.bad_batches == 3
    assert int(opt.iterations) == 9


def test_keras_stock_class_counts_the_bad_batch_and_terminate_on_nan_stops():
    """What ours fixes: the stock class's epoch loss is NaN and the run stops in epoch 1."""
    x, y, _ = _data()
    history, opt = _fit(x, y, jit_compile=True, epochs=3, stock=True)
    assert len(history["loss"]) == 1 and np.isnan(history["loss"][0])
    assert int(opt.iterations) == 1  # Stopped at the bad batch (the stock skip holds it).


class _TwoHeads(keras.Model):
    """Two outputs, each with a loss tracker `compute_loss` updates, and a `compute_metrics`
    that adds a log of its own."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {**super().compute_metrics(x, y, y_pred, sample_weight), "extra": 42.0}


def _fit_two_heads(x: np.ndarray, y: np.ndarray, jit_compile: bool) -> dict[str, list[float]]:
    inputs = keras.Input((3,))
    outputs = [keras.layers.Dense(1, name=name)(inputs) for name in ("a", "b")]
    model = _TwoHeads(inputs, outputs, name="two_heads")
    rng = np.random.RandomState(0)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss=["mse", "mse"], jit_compile=jit_compile)
    history = model.fit(x, [y, 2 * y], batch_size=4, shuffle=False, verbose=0)
    return history.history


@pytest.mark.parametrize("jit_compile", [False, True])
def test_per_output_losses_leave_out_the_bad_batch_and_own_logs_stay(jit_compile):
    """`compute_loss` updates each output's loss tracker before the optimizer judges the
    batch: they are put back too; a `compute_metrics` override's own log is kept."""
    x, y, good = _data()
    history = _fit_two_heads(x, y, jit_compile)
    reference = _fit_two_heads(x[good], y[good], jit_compile)
    assert history["extra"] == [42.0]
    for name in ("loss", "a_loss", "b_loss"):
        assert np.isfinite(history[name]).all(), name
        np.testing.assert_allclose(history[name], reference[name], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(history["loss"], np.add(history["a_loss"], history["b_loss"]))


def _own_step_class(logs: str = "metrics") -> type[keras.Sequential]:
    """TensorFlow: the train_step of Keras' guide ("Customizing what happens in fit()"),
    which updates each metric itself and logs their results (`logs="metrics"`); or logs the
    batch's loss under the name of Keras' loss tracker, which it never updates ("raw_loss");
    or applies its gradients in a `tf.function` of its own, and logs the metrics ("nested")."""
    import tensorflow as tf

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            if logs == "nested":
                tf.function(lambda: self.optimizer.apply(grads, self.trainable_variables))()
            else:
                self.optimizer.apply(grads, self.trainable_variables)
            if logs == "raw_loss":
                return {"loss": loss}
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return OwnStep


_OWN_STEP_ON_JAX = (
    "on JAX a model's own traced step hands no batch to stateless_apply: NaN data is an "
    "overflow there (docs/loss_scaling.md)"
)
# The bad batch last: an epoch's logs are its last batch's.
_LAST_BAD = np.r_[0:4, 8:12, 4:8]


@pytest.mark.skipif(BACKEND == "jax", reason=_OWN_STEP_ON_JAX)
@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_models_own_step_leaves_the_bad_batch_out_of_the_metrics_it_updates(jit_compile):
    """Its logs hold Keras' compile metrics as a dict (`compile_metrics`): read again too."""
    x, y, good = _data()
    history, opt = _fit(
        x[_LAST_BAD], y[_LAST_BAD], jit_compile, epochs=2, model_class=_own_step_class()
    )
    reference, _ = _fit(x[good], y[good], jit_compile, epochs=2, model_class=_own_step_class())
    assert opt.bad_batches == 2  # TerminateOnNaN trained on.
    for name in ("loss", "mae"):
        assert np.isfinite(history[name]).all(), name
        np.testing.assert_allclose(history[name], reference[name], rtol=1e-6, err_msg=name)


@pytest.mark.skipif(BACKEND == "jax", reason=_OWN_STEP_ON_JAX)
def test_a_models_own_raw_loss_log_is_its_own():
    """Logged under the name of a metric the step never updates: kept as the step gave it,
    a NaN where the last batch is bad (not the idle tracker's 0), the loss where good."""
    x, y, good = _data()
    raw_loss = _own_step_class("raw_loss")
    history, opt = _fit(x[_LAST_BAD], y[_LAST_BAD], True, model_class=raw_loss, metrics=())
    assert opt.bad_batches == 1 and np.isnan(history["loss"]).all()
    history, _ = _fit(x[good], y[good], True, model_class=raw_loss, metrics=())
    # The last batch's MSE after one SGD step on the first, as NumPy computes it.
    np.testing.assert_allclose(history["loss"], [2.4992123], rtol=1e-6)


@pytest.mark.skipif(BACKEND == "jax", reason=_OWN_STEP_ON_JAX)
def test_a_models_own_step_applying_in_a_function_of_its_own_skips_nan_as_an_overflow():
    """`apply` in a graph of its own sees no batch (handed over in the step's graph), and its
    verdict cannot be read in the step's: the NaN batch is skipped as an overflow, its
    metrics not put back (docs/loss_scaling.md); training runs."""
    x, y, _ = _data()
    history, opt = _fit(x[_LAST_BAD], y[_LAST_BAD], True, model_class=_own_step_class("nested"))
    assert (opt.skipped_steps, opt.bad_batches, int(opt.iterations)) == (1, 0, 3)
    assert opt.loss_scale == 2.0**14
    assert np.isnan(history["loss"]).all()
