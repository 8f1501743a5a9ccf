"""Tests of backend.tensorflow.train_function: the train function, without Keras' Optional."""

import keras
import numpy as np
import pytest

from mpt_keras.execution import xla
from mpt_keras.scaling.optimizer import LossScaleOptimizer


def _model(**compile_kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    xla.compile_model(model, optimizer=optimizer, loss="mse", jit_compile=False, **compile_kwargs)
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(10, 3)).astype("float32"), rng.normal(size=(10, 1)).astype("float32")


def _is_ours(model: keras.Model) -> bool:
    return model.train_function.__qualname__.startswith("_direct.")


def test_fit_ends_each_epoch_at_the_end_of_the_data_and_says_nothing(capfd):
    model = _model()
    history = model.fit(*_data(), batch_size=4, epochs=2, verbose=0)
    assert _is_ours(model)
    assert int(model.optimizer.iterations) == 6  # 3 batches (the last one partial) a epoch
    assert len(history.history["loss"]) == 2
    assert "OUT_OF_RANGE" not in capfd.readouterr().err


def test_trains_exactly_as_keras_own_train_function():
    weights = []
    for ours in (True, False):
        model = _model()
        if not ours:
            del model.make_train_function  # Keras' own, on the same train step.
        history = model.fit(*_data(), batch_size=4, epochs=2, shuffle=False, verbose=0)
        assert _is_ours(model) is ours
        weights.append((history.history, [w.numpy() for w in model.trainable_weights]))
    (ours_history, ours_weights), (keras_history, keras_weights) = weights
    assert ours_history == keras_history
    for got, want in zip(ours_weights, keras_weights, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_step_is_traced_once_though_keras_builds_its_metrics_in_the_first_trace():
    """Without a strategy Keras builds the compiled metrics inside the first trace, and a
    function whose first trace made variables is traced again; built first: one trace."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01))
    xla.compile_model(model, optimizer=optimizer, loss="mse", metrics=["mae"], jit_compile=False)
    traces, step = [], model.train_step

    def counting_step(data):
        traces.append(len(traces))  # Python runs once per trace.
        return step(data)

    model.train_step = counting_step
    x, y = _data()
    history = model.fit(x[:8], y[:8], batch_size=4, epochs=2, verbose=0)
    assert _is_ours(model) and "mae" in history.history
    assert traces == [0]


@pytest.mark.parametrize(
    "case", ["steps_per_execution", "run_eagerly", "compiled_again", "train_on_batch"]
)
def test_keras_own_function_serves_the_rest(case):
    compile_kwargs = {
        "steps_per_execution": {"steps_per_execution": 2},
        "run_eagerly": {"run_eagerly": True},
    }.get(case, {})
    model = _model(**compile_kwargs)
    x, y = _data()
    if case == "compiled_again":
        model.compile(optimizer=model.optimizer, loss="mae")
    if case == "train_on_batch":
        logs = model.train_on_batch(x[:4], y[:4], return_dict=True)
        assert np.isfinite(logs["loss"]) and logs["skipped_steps"] == 0.0
        return  # Through ours, which hands a batch that is no iterator to Keras'.
    model.fit(x, y, batch_size=4, verbose=0)
    assert not _is_ours(model)
    assert int(model.optimizer.iterations) == 3
