"""A tensor's values, of any kind: dense, ragged, sparse, indexed slices."""

from __future__ import annotations

from typing import Any

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
