"""Touches of Keras' JAX trainer: the metric update the loss-scaling train step reuses, the
stateless scope a JAX train step reads its variables through, and `fit`'s step loop
(`mpt-bench` times steps as `fit` runs them)."""

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


def jax_trainer_class() -> type:
    """Keras' JAX trainer class, whose private methods this module calls (imports JAX)."""
    from keras.src.backend.jax.trainer import JAXTrainer

    return JAXTrainer


_STATE_PARTS = (
    "trainable_variables",
    "non_trainable_variables",
    "optimizer_variables",
    "metrics_variables",
)


def fit_train_step(model: keras.Model, state: Any, iterator: Any) -> tuple[dict[str, Any], Any]:
    """One train step on `next(iterator)` as Keras' JAX `fit` runs it: `(logs, state)`.

    The state passes from step to step on the device (`state` None at the first step). It is
    taken from the variables (which give up their values, as in `fit`) only when they hold
    it: at the first step, or after a callback synced it (`model.jax_state_sync()`, which
    puts it back). Call `make_train_function` first, and `jax_state_sync` before reading a
    variable.
    """
    if state is None or model._jax_state_synced:
        state = model._get_jax_state(
            **dict.fromkeys(_STATE_PARTS, True), purge_model_variables=True
        )
        model._jax_state_synced = False
    logs, state = model.train_function(state, iterator)
    # Where callbacks sync it from (Keras keeps its own copy: it tracks the attribute's lists).
    model._jax_state = dict(zip(_STATE_PARTS, state, strict=True))
    return logs, state
