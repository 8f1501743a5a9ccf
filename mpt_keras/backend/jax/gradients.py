"""Gradients of a model's loss through `jax.grad` of `model.stateless_call`: nothing
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


def recorded_gradients(
    model: keras.Model,
    recorder: Any,
    variables: list[keras.Variable],
    loss: Callable[..., Any],
    features: Any,
    labels: Any,
    sample_weight: Any,
) -> tuple[list[Any], list[Any]]:
    """As TensorFlow's: `jax.grad` through `stateless_call`, with a zero added to each matmul
    output that `recorder` recorded in an eager pass (its gradient is the output's)."""
    import jax.numpy as jnp

    with recorder.recording(lambda outputs: outputs):
        model(features, training=False)
    probes = [jnp.zeros(output.shape, output.dtype) for output in recorder.outputs]
    trainable = model.trainable_variables
    positions = {id(variable): index for index, variable in enumerate(trainable)}
    non_trainable = [variable.value for variable in model.non_trainable_variables]

    def value(trainable_values: list[Any], probe_values: list[Any]) -> Any:
        remaining = iter(probe_values)
        with recorder.recording(lambda outputs: outputs + next(remaining), record=False):
            predictions, _ = model.stateless_call(
                trainable_values, non_trainable, features, training=False
            )
        return loss(labels, predictions, sample_weight=sample_weight)

    gradients, output_gradients = jax.grad(value, argnums=(0, 1))(
        [variable.value for variable in trainable], probes
    )
    return [gradients[positions[id(v)]] for v in variables], output_gradients
