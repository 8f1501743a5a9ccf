"""Gradients of a model's loss through `jax.value_and_grad` of `model.stateless_call`: nothing
is written to the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import keras


def loss_and_gradients(model: keras.Model, x: Any, loss_of: Callable) -> tuple[Any, list]:
    """`loss_of(model(x))` and its gradients for `model.trainable_variables`."""
    non_trainable = [v.value for v in model.non_trainable_variables]

    def value_of(trainable: list[Any]) -> Any:
        y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=False)
        return loss_of(y_pred)

    return jax.value_and_grad(value_of)([v.value for v in model.trainable_variables])
