"""Tests of mpt_keras.keras_bridge.layer_calls: wrapped inside the block, as before after it."""

import keras
import numpy as np
import pytest

from mpt_keras.keras_bridge.layer_calls import calls_before_cast, calls_wrapped, run_method


def _counting(seen):
    def wrap(layer, call):
        def counted(*args, **kwargs):
            seen.append(layer.name)
            return call(*args, **kwargs)

        return counted

    return wrap


def _model():
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(3, name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))


def test_each_call_inside_the_block_goes_through_the_wrapper_and_none_after():
    model, seen = _model(), []
    with calls_wrapped(model.layers[1:], _counting(seen)):
        model(np.ones((1, 2), "float32"))
    assert seen == ["hidden", "out"]
    model(np.ones((1, 2), "float32"))
    assert seen == ["hidden", "out"]
    assert all("call" not in vars(layer) for layer in model.layers)


def test_an_instance_call_and_a_layer_given_twice_are_restored_even_on_error():
    model, seen = _model(), []
    hidden = model.get_layer("hidden")
    own = hidden.call
    hidden.call = own  # Set on the instance, as a user's patch would be.
    with pytest.raises(ValueError):
        with calls_wrapped([hidden, hidden], _counting(seen)):
            model(np.ones((1, 2), "float32"))
            raise ValueError("the model failed")
    assert seen == ["hidden", "hidden"]
    assert vars(hidden)["call"] is own


def test_a_float8_layer_is_watched_in_the_quantized_call_keras_runs_instead_of_call():
    model, seen = _model(), []
    model.get_layer("out").quantize("float8")
    assert [run_method(layer) for layer in model.layers[1:]] == ["call", "quantized_call"]
    with calls_wrapped(model.layers[1:], _counting(seen)):
        model(np.ones((1, 2), "float32"))
    assert seen == ["hidden", "out"]
    model(np.ones((1, 2), "float32"))
    assert seen == ["hidden", "out"]
    assert all({"call", "quantized_call"}.isdisjoint(vars(layer)) for layer in model.layers)


def test_calls_before_cast_sees_the_inputs_as_given_and_puts_call_back():
    original = vars(keras.layers.Layer)["__call__"]
    dense = keras.layers.Dense(1, dtype="mixed_float16")
    dense.build((None, 1))
    seen = []

    def record(layer, args, kwargs, outputs):
        seen.append((layer, float(np.max(args[0])), keras.backend.standardize_dtype(outputs.dtype)))

    with pytest.raises(RuntimeError):
        with calls_before_cast(record):
            dense(np.array([[1e5]], dtype="float32"))
            raise RuntimeError
    # Before the cast, 1e5 is finite in float32; after it, inf in float16.
    assert seen == [(dense, 1e5, "float16")]
    assert vars(keras.layers.Layer)["__call__"] is original
