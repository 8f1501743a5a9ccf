"""Gradients of a model's loss through `tf.GradientTape`, traced: Keras' float8 layers take
no gradient eagerly (Keras 3.15.1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf


def gradient_tape_scope() -> Callable[[], Any]:
    """The name scope TensorFlow's autodiff gives gradients of ops made here (captured now)."""
    scope = tf.get_current_name_scope()
    return lambda: tf.name_scope(f"gradient_tape/{scope}/" if scope else "gradient_tape/")


def taped_value_and_gradients(
    compute: Callable[[], tuple[Any, Any]], variables: list[Any]
) -> tuple[Any, Any, list]:
    """`compute()` gives `(value, aux)`; returns them and `value`'s gradients with respect to
    `variables`, taped where it runs (eagerly, or in the caller's trace)."""
    with tf.GradientTape() as tape:
        value, aux = compute()
    return value, aux, tape.gradient(value, variables)


def traced_value_and_gradients(
    compute: Callable[..., tuple[Any, Any]], variables: Callable[[], list[keras.Variable]]
) -> Callable[..., tuple[Any, Any, list]]:
    """A traced `(*args) -> (value, aux, gradients)`: `compute(*args)` gives `(value, aux)`;
    the gradients are `value`'s with respect to `variables()` (None where disconnected)."""

    @tf.function(autograph=False)
    def value_and_gradients(*args: Any):
        watched = variables()
        with tf.GradientTape() as tape:
            value, aux = compute(*args)
        return value, aux, tape.gradient(value, watched)

    return value_and_gradients


def loss_and_gradients(model: keras.Model, x: Any, loss_of: Callable) -> tuple[Any, list]:
    """`loss_of(model(x))` and its gradients for `model.trainable_variables`."""
    run = traced_value_and_gradients(
        lambda x: (loss_of(model(x, training=False)), ()), lambda: model.trainable_variables
    )
    value, _, gradients = run(x)
    return value, gradients


def recorded_gradients(
    model: keras.Model,
    recorder: Any,
    variables: list[keras.Variable],
    loss: Callable[..., Any],
    features: Any,
    labels: Any,
    sample_weight: Any,
) -> tuple[list[Any], list[Any]]:
    """The loss's gradients at `variables` (dense) and at the matmul outputs that `recorder`
    (calibration's `Float8Recorder`) records in the same taped pass."""

    def watched(outputs: Any) -> Any:
        tape.watch(outputs)
        return outputs

    with tf.GradientTape() as tape, recorder.recording(watched):
        predictions = model(features, training=False)
        value = loss(labels, predictions, sample_weight=sample_weight)
    gradients, output_gradients = tape.gradient(value, (variables, recorder.outputs))
    # An embedding's gradient comes as IndexedSlices.
    return [None if g is None else tf.convert_to_tensor(g) for g in gradients], output_gradients
