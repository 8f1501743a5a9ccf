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
