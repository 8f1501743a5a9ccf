"""The step's verdict: finite gradients, an overflow, or a bad batch; and the gradient norm.

One float32 sum of squares per gradient serves both the verdict and the norm.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import tensorflow as tf
from keras import ops

from mpt_keras.backend.tensorflow.values import dense_values


class GradientVerdict(NamedTuple):
    """What the all-reduced, unscaled gradients say."""

    halves: list[tf.Tensor]  # `sum(g**2) / 2` of each judged (not float8 state) gradient.
    half_total: tf.Tensor  # Their sum: half the squared global norm.
    new_values_finite: list[tf.Tensor]  # Per float8 new value, whether it is finite.
    finite: tf.Tensor  # Whether the step may apply: all finite, and no bad batch.
    order: list[int]  # The gradients' indices: judged ones first, then new values.


def judge_gradients(
    grads: list[Any], overwritten: list[bool], bad_batch: tf.Tensor
) -> GradientVerdict:
    """Judges the gradients; `overwritten` marks float8 new values (judged, not normed).

    A half sum of squares is finite iff every element is and the norm is below about 1.8e19
    (where Adam's second moment overflows). A float8 layer clips what it quantizes, so an
    overflow may show in its new values only.
    """
    judged = [i for i, o in enumerate(overwritten) if not o]
    new_values = [i for i, o in enumerate(overwritten) if o]
    halves = [half_sum_of_squares(grads[i]) for i in judged]
    half_total = tf.add_n(halves) if halves else ops.zeros(())
    new_values_finite = [ops.all(ops.isfinite(grads[i])) for i in new_values]
    finite = ops.isfinite(half_total) & ~bad_batch
    if new_values_finite:
        finite &= ops.all(ops.stack(new_values_finite))
    return GradientVerdict(halves, half_total, new_values_finite, finite, judged + new_values)


def batch_verdict(loss: tf.Tensor | None, batch: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """Whether any replica's batch (or, without one, loss) is bad data; and the summed loss.

    With the batch, a NaN or Inf in it is bad data (a non-finite loss from a finite batch is
    an overflow); without, a NaN loss is, an infinite one is not.
    """
    if loss is None:
        loss = ops.zeros((), "float32")
    loss = ops.cast(loss, "float32")
    loss_is_nan = ops.any(ops.isnan(loss))
    loss = ops.sum(loss)
    if batch is None:
        flags = [loss_is_nan]
    else:
        values = [dense_values(t) for t in keras.tree.flatten(batch)]
        flags = [
            ~ops.all(ops.isfinite(v)) for v in values if v is not None and v.dtype.is_floating
        ] or [ops.convert_to_tensor(False)]
    bad = ops.any(ops.stack(flags))
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        # One all-reduce of the votes and the (distribution-scaled) losses: all replicas agree.
        votes, loss = ops.unstack(
            context.all_reduce(
                tf.distribute.ReduceOp.SUM, ops.stack([ops.cast(bad, "float32"), loss])
            )
        )
        bad = votes > 0
    return bad, loss


def unscale(gradient: tf.Tensor, scale: tf.Tensor | keras.Variable) -> tf.Tensor:
    # ops.divide promotes float16 to float32 (the scale's dtype): no flush to zero.
    return ops.divide(gradient, scale)


def unscaled_like(
    gradient: tf.Tensor | tf.IndexedSlices, scale: tf.Tensor | keras.Variable
) -> tf.Tensor | tf.IndexedSlices:
    """`gradient / scale` (computed in float32) in the gradient's dtype and form."""
    if isinstance(gradient, tf.IndexedSlices):
        values = unscaled_like(gradient.values, scale)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return ops.cast(unscale(gradient, scale), gradient.dtype)


def half_sum_of_squares(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """`sum(g**2) / 2` in float32 (a float16 square above 256 would overflow), not densified."""
    values = dense_values(gradient)
    if values is None:  # A NumPy gradient of the caller's.
        values = tf.convert_to_tensor(gradient)
    if values.dtype != tf.float32:
        values = tf.cast(values, tf.float32)
    return tf.nn.l2_loss(values)
