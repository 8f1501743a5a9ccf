"""The step's distribution plumbing: the gradient all-reduce and the cross-replica writes.

Every replica must see the same gradients and write the same verdict, or replicas diverge.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import ops

from mpt_keras.backend.tensorflow.values import tf_variable


def all_reduce_gradients(
    grads: list[Any], overwritten: list[bool], all_reduce_dtype: str | None
) -> list[Any]:
    """Sums the gradients over the replicas; a float8 new value (`overwritten`) takes the largest.

    The largest is what one device would compute from the whole batch (the global amax, the
    shared scale); a sum would multiply it by the replicas. `all_reduce_dtype`: on the wire.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return grads
    summed = [i for i, o in enumerate(overwritten) if not o]
    largest = [i for i, o in enumerate(overwritten) if o]
    reduced = list(grads)
    values = [grads[i] for i in summed]
    if all_reduce_dtype is not None:
        values = [tf.cast(g, all_reduce_dtype) for g in values]
    for i, g in zip(summed, context.all_reduce(tf.distribute.ReduceOp.SUM, values)):
        reduced[i] = tf.cast(g, grads[i].dtype)
    if largest:
        gathered = context.all_gather([grads[i][None] for i in largest], axis=0)
        for i, g in zip(largest, gathered):
            reduced[i] = ops.max(g, axis=0)
    return reduced


class Writer:
    """Writes optimizer variables in the cross-replica context (or with no strategy)."""

    def __init__(self, distribution: tf.distribute.Strategy) -> None:
        self._update = distribution.extended.update

    def assign(self, variable: keras.Variable, value: Any) -> None:
        self._update(tf_variable(variable), _assign, args=(value,), group=False)

    def add(self, variable: keras.Variable, value: Any) -> None:
        self._update(tf_variable(variable), _assign_add, args=(value,), group=False)


def first_replica(distribution: tf.distribute.Strategy, value: Any) -> Any:
    """The first replica's value (of each in a list): for values every replica holds alike."""
    if isinstance(value, list):
        return [first_replica(distribution, v) for v in value]
    return distribution.experimental_local_results(value)[0]


def current_graph() -> Any:
    return tf.compat.v1.get_default_graph()


def replica_trace_key() -> tuple[int, int]:
    """This replica in this trace: its graph and its replica context."""
    return id(current_graph()), id(tf.distribute.get_replica_context())


def _assign(variable: tf.Variable, value: tf.Tensor) -> None:
    variable.assign(value)


def _assign_add(variable: tf.Variable, value: tf.Tensor) -> None:
    variable.assign_add(ops.cast(value, variable.dtype))
