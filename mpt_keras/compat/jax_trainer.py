"""Touches of Keras' JAX trainer: the metric update the loss-scaling train step reuses, and
the stateless scope a JAX train step reads its variables through."""

from __future__ import annotations

from typing import Any

import keras


def update_metrics_variables(
    model: keras.Model,
    metrics_variables: list[Any],
    unscaled_loss: Any,
    x: Any,
    y: Any,
    y_pred: Any,
    sample_weight: Any,
) -> tuple[dict[str, Any], list[Any]]:
    """The step's logs and new metric values, as Keras' JAX `train_step` computes them."""
    return model._update_metrics_variables(
        metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )


def stateless_value(variable: keras.Variable) -> Any:
    """The value the `keras.StatelessScope` in effect maps `variable` to; None outside one or
    where it maps other variables (in a JAX train step, Keras has set the value aside)."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    return None if scope is None else scope.get_current_value(variable)
