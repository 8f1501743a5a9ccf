"""XLA-compiled programs on JAX: a model's train step (its optimized HLO, never run) and a
function's gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import keras

from mpt_keras.backend.jax import gpu_targets


def train_step_hlo(model: keras.Model, batch: Any, target: str | None = None) -> str:
    """The optimized HLO text of `model.train_step` on `batch`, as Keras' JAX trainer jits it
    (one step, the model's state as its argument), for this machine's device or compiled for
    the GPU `target` (`backend.names.GPU_TARGETS`). The model, loss, metrics and optimizer are
    built; nothing is run or assigned."""
    state = (
        [variable.value for variable in model.trainable_variables],
        [variable.value for variable in model.non_trainable_variables],
        [variable.value for variable in model.optimizer.variables],
        [variable.value for variable in model.metrics_variables],
    )
    if target is not None:
        return gpu_targets.optimized_hlo(model.train_step, (state, batch), target)
    return jax.jit(model.train_step).lower(state, batch).compile().as_text()


def compiled_gradients(loss: Callable[..., Any]) -> Callable[..., Any]:
    """`loss`'s gradients for each of its arguments, XLA-compiled (`jax.jit(jax.grad)`)."""
    return jax.jit(lambda *args: jax.grad(loss, argnums=tuple(range(len(args))))(*args))
