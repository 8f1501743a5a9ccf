"""Keras' TensorFlow train step rebuilt in two parts, so XLA can take the first or both:
the forward and backward pass, then `optimizer.apply`, the loss tracker and the metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from mpt_keras import compat
from mpt_keras.backend.tensorflow.gradients import taped_value_and_gradients
from mpt_keras.backend.tensorflow.values import leading_size
from mpt_keras.scaling.bad_batch_metrics import MetricsBefore
from mpt_keras.scaling.hand_over import state_before
from mpt_keras.scaling.optimizer import LossScaleOptimizer

ForwardBackward = Callable[[Any, Any, Any], tuple[Any, Any, Any]]


def make_forward_backward(model: keras.Model) -> ForwardBackward:
    """`(x, y, sample_weight) -> (loss, y_pred, gradients of optimizer.scale_loss(loss))`."""

    def replica_forward_backward(x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        # As Keras' own train step.
        def scaled_loss() -> tuple[Any, tuple[Any, Any]]:
            y_pred = model(x, training=True) if compat.call_has_training_arg(model) else model(x)
            loss = compat.compute_loss(
                model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            return model.optimizer.scale_loss(loss), (loss, y_pred)

        _, (loss, y_pred), gradients = taped_value_and_gradients(
            scaled_loss, model.trainable_weights
        )
        return loss, y_pred, gradients

    return replica_forward_backward


def make_step(
    model: keras.Model, forward_backward: ForwardBackward
) -> Callable[[Any, Any, Any], dict[str, Any]]:
    """The whole step on `(x, y, sample_weight)`; returns the logs.

    With a `mpt_keras.LossScaleOptimizer`, a batch holding a NaN or Inf is skipped as bad
    data, and counts in neither the loss nor any metric.
    """

    def replica_train_step(x: Any, y: Any, sample_weight: Any) -> dict[str, Any]:
        optimizer = model.optimizer
        checked = isinstance(optimizer, LossScaleOptimizer)
        # Batch-norm statistics as before the step: a skipped step puts them back.
        state = state_before(model.non_trainable_variables) if checked else []
        # A skipped bad batch counts in no metric (`bad_batch_metrics`); read before
        # `compute_loss`, which updates per-output loss trackers.
        before = MetricsBefore(model) if checked else None
        loss, y_pred, gradients = forward_backward(x, y, sample_weight)
        batch_size = leading_size(next(i for i in keras.tree.flatten(x) if i is not None))
        if checked:
            # Explicitly: the loss `scale_loss` got may be in a nested XLA function's graph.
            bad = optimizer.apply(
                gradients,
                model.trainable_weights,
                loss=loss,
                batch=(x, y, sample_weight),
                state=state,
            )
        else:
            optimizer.apply(gradients, model.trainable_weights)
        compat.loss_tracker(model).update_state(
            compat.unscale_loss_for_distribution(loss), sample_weight=batch_size
        )
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if before is None:
            return logs
        before.put_back_if(bad)
        return {**logs, **model.get_metrics_result(), **optimizer.step_logs()}

    return replica_train_step
