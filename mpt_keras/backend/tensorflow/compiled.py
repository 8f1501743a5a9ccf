"""The optimized XLA program of a model's train step on TensorFlow, compiled and never run."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf


def train_step_hlo(model: keras.Model, batch: Any) -> str:
    """The optimized HLO text of `model.train_step` on `batch` as XLA compiles it
    (`jit_compile=True`, one replica's step). The model, loss, metrics and optimizer are
    built; nothing is run or assigned."""
    batch = keras.tree.map_structure(tf.convert_to_tensor, batch)
    # No autograph, as the run's own steps (train_function.py): the same graph, traced faster.
    step = tf.function(model.train_step, jit_compile=True, autograph=False)
    return step.experimental_get_compiler_ir(batch)(stage="optimized_hlo")
