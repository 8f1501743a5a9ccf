"""keras_hub task models (`GPT2CausalLM`) take the runs' iterator of batches, on either backend.

keras_hub's `Task.fit` and `Task.evaluate` build a dataset of their own from what they get,
and a Python iterator is none they can build one from: a run's batches on Keras' JAX backend
are one. `keras_bridge.task_models` calls Keras' own methods on a task without a
preprocessor, and any other model's own.
"""

import keras
import keras_hub
import numpy as np
import pytest

from mpt_keras.keras_bridge import task_models


def _task() -> keras_hub.models.GPT2CausalLM:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=8,
        num_layers=1,
        num_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=4,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", weighted_metrics=[])
    return model


def _batches():
    """Batches as a run yields them on JAX: a generator of `(x, y)` arrays, endless."""
    rng = np.random.default_rng(0)
    while True:
        ids = rng.integers(0, 8, (2, 4)).astype("int32")
        yield {"token_ids": ids, "padding_mask": np.ones((2, 4), "int32")}, ids


def test_a_task_without_a_preprocessor_is_fitted_and_evaluated_as_a_keras_model():
    model = _task()
    # keras_hub's own methods cannot take it (ImportError: with neither TensorFlow nor grain).
    with pytest.raises((ValueError, TypeError, ImportError)):
        model.fit(_batches(), steps_per_epoch=1, shuffle=False, verbose=0)

    history = task_models.fit(
        model, _batches(), steps_per_epoch=2, epochs=2, shuffle=False, verbose=0
    )

    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations) == 4
    results = task_models.evaluate(model, _batches(), steps=1, return_dict=True, verbose=0)
    assert set(results) == {"loss"} and np.isfinite(results["loss"])


def test_any_other_models_own_methods_are_called():
    class OwnFit(keras.Model):
        def fit(self, *args, **kwargs):
            return ("own fit", args, kwargs)

        def evaluate(self, *args, **kwargs):
            return ("own evaluate", args, kwargs)

    inputs = keras.Input((2,))
    model = OwnFit(inputs, keras.layers.Dense(1)(inputs))

    assert task_models.fit(model, "data", epochs=3) == ("own fit", ("data",), {"epochs": 3})
    assert task_models.evaluate(model, "data") == ("own evaluate", ("data",), {})
