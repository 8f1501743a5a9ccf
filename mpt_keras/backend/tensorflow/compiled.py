"""XLA-compiled programs on TensorFlow: a model's train step (its optimized HLO, never run)
and a function's gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf


def xla_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` XLA-compiled; no autograph, as Keras' own XLA step (`do_not_convert`)."""
    return tf.function(function, jit_compile=True, autograph=False)


def train_step_hlo(model: keras.Model, batch: Any) -> str:
    """The optimized HLO text of `model.train_step` on `batch` as XLA compiles it
    (`jit_compile=True`, one replica's step). The model, loss, metrics and optimizer are
    built; nothing is run or assigned."""
    batch = keras.tree.map_structure(tf.convert_to_tensor, batch)
    # No autograph, as the run's own steps (train_function.py): the same graph, traced faster.
    step = tf.function(model.train_step, jit_compile=True, autograph=False)
    return step.experimental_get_compiler_ir(batch)(stage="optimized_hlo")


def compiled_gradients(loss: Callable[..., Any]) -> Callable[..., Any]:
    """`loss`'s gradients for each of its arguments, XLA-compiled (`jit_compile=True`)."""

    @tf.function(jit_compile=True, autograph=False)
    def gradients(*args: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            tape.watch(args)
            value = loss(*args)
        return tape.gradient(value, list(args))

    return gradients
