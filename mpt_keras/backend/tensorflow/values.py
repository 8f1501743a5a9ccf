"""A tensor's values, of any kind: dense, ragged, sparse, indexed slices; a variable's tf.Variable
and a copy of its value."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf


def dense_values(value: Any) -> tf.Tensor | None:
    """`value`'s values as one dense tensor; None if it is no tensor.

    Ragged: flat values; sparse, indexed slices: stored values (no densified copy's zeros).
    """
    if isinstance(value, (tf.SparseTensor, tf.IndexedSlices)):
        return value.values
    if isinstance(value, tf.RaggedTensor):
        return value.flat_values
    return value if tf.is_tensor(value) else None


def tf_variable(variable: keras.Variable | tf.Variable) -> tf.Variable:
    """The `tf.Variable` behind a Keras variable (or `variable` itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def copied_value(variable: keras.Variable | tf.Variable) -> tf.Tensor:
    """A copy of `variable`'s value now: `tf.identity` reads one, where
    `ops.convert_to_tensor` would give the variable back."""
    return tf.identity(tf_variable(variable))


def read_value(variable: keras.Variable | tf.Variable) -> tf.Tensor:
    """`variable`'s value now, as one read (in a trace, a read op ordered before later writes)."""
    return tf.convert_to_tensor(variable)


def leading_size(tensor: Any) -> tf.Tensor:
    """`tensor`'s first dimension as a tensor (`tf.shape`), known or not in the trace."""
    return tf.shape(tensor)[0]
