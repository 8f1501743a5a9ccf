"""The values of a TensorFlow tensor of any kind: dense, ragged, sparse or indexed slices."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def dense_values(value: Any) -> tf.Tensor | None:
    """`value`'s values as one dense tensor; None if it is no tensor.

    A ragged tensor gives its flat values, a sparse tensor or indexed slices
    their stored values: the numbers a finiteness check must see, without the
    zeros a densified copy would add.
    """
    if isinstance(value, (tf.SparseTensor, tf.IndexedSlices)):
        return value.values
    if isinstance(value, tf.RaggedTensor):
        return value.flat_values
    return value if tf.is_tensor(value) else None
