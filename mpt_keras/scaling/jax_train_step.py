"""The train step a model compiled with our optimizer runs on Keras' JAX backend.

Keras' JAX `train_step`, with what it never gives the optimizer: the batch and the unscaled
loss (bad data told from an overflow), the forward pass's state put back on a skipped step
(batch-norm statistics of a NaN batch), the metrics as before a bad batch, and the
loss-scaling step logs. Pure, as Keras jits it.
"""

from __future__ import annotations

from typing import Any

import jax
import keras
from keras import ops

from mpt_keras import compat
from mpt_keras.scaling import bad_batch_metrics

# Ours (not imported: it imports this module).
_Optimizer = keras.optimizers.LossScaleOptimizer


def train_step(model: keras.Model, optimizer: _Optimizer, state: Any, data: Any) -> Any:
    """Keras' `JAXTrainer.train_step(state, data)` with loss scaling that sees the batch."""
    trainable, non_trainable, optimizer_values, metrics_before = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    gradients = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
    with optimizer.model_train_step(model.name):  # An override may never scale its loss.
        (_, aux), grads = gradients(
            trainable,
            non_trainable,
            metrics_before,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=optimizer_values,
        )
        unscaled_loss, y_pred, new_non_trainable, metrics_values = aux
        new_trainable, new_optimizer = optimizer.stateless_apply(
            optimizer_values, grads, trainable, loss=unscaled_loss, batch=data
        )
    skipped = optimizer.stateless_skipped(optimizer_values, new_optimizer)
    new_non_trainable = [
        ops.where(skipped, old, new) if keras.backend.is_float_dtype(v.dtype) else new
        for v, old, new in zip(model.non_trainable_variables, non_trainable, new_non_trainable)
    ]
    metric_logs, new_metrics = compat.update_metrics_variables(
        model, metrics_values, unscaled_loss, x, y, y_pred, sample_weight
    )
    # As before the step, where bad: `compute_loss` has updated per-output loss trackers too.
    bad = optimizer.stateless_skipped(optimizer_values, new_optimizer, bad_batch=True)
    metrics_values = bad_batch_metrics.kept_values(bad, metrics_before, new_metrics)
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics_values))):
        logs = {**metric_logs, **model.get_metrics_result()}  # A `compute_metrics`' own too.
    logs = {**logs, **optimizer.step_logs(new_optimizer, new_trainable)}
    return logs, (new_trainable, new_non_trainable, new_optimizer, metrics_values)
