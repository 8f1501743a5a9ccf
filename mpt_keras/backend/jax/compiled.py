"""XLA-compiled programs on JAX: a model's train step (its optimized HLO, never run; whether
this device's XLA can lower it) and a function's gradients."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras

from mpt_keras.backend.jax import gpu_targets
from mpt_keras.errors import first_line
from mpt_keras.keras_bridge.traced_functions import fresh_copy


def train_step_hlo(model: keras.Model, batch: Any, target: str | None = None) -> str:
    """The optimized HLO text of `model.train_step` on `batch`, as Keras' JAX trainer jits it
    (one step, the model's state as its argument), for this machine's device or compiled for
    the GPU `target` (`backend.names.GPU_TARGETS`). The model, loss, metrics and optimizer are
    built; nothing is run or assigned."""
    # A copy JAX never traced: after `fit` jitted `model.train_step` on such a batch, lowering
    # it again gave that trace back, made before the census scoped each float8 layer's calls,
    # and no GEMM was found (`tests/any_backend/test_float8_census.py`).
    step = fresh_copy(model.train_step)
    if target is not None:
        return gpu_targets.optimized_hlo(step, (_state(model), batch), target)
    return jax.jit(step).lower(_state(model), batch).compile().as_text()


# JAX's CPU lowering refuses a dot of float16 operands summed in float32 (JAX 0.10).
_NO_FLOAT16_SUMS = "is not supported by dot_general on CPU"


def unlowerable_float16_dot(model: keras.Model, batch: Any) -> str | None:
    """JAX's reason if this device cannot lower `model.train_step` on `batch` for a dot of
    float16 operands summed in float32, else None (lowered, neither compiled nor run).

    `jax.nn.dot_product_attention`, which Keras' attention layers call, asks for that sum in
    float16; a CPU lacks it, and its eager fallback does not reach a jitted step (the error
    comes at lowering, after the trace; keras-team/keras-hub#2354). Where the device has the
    sum, nothing is traced.
    """
    if not lacks_float16_sums():
        return None
    try:
        jax.jit(model.train_step).lower(_state(model), batch)
    except ValueError as error:
        if _NO_FLOAT16_SUMS in str(error):
            return first_line(error)
        raise
    return None


@functools.cache
def lacks_float16_sums() -> bool:
    """Whether this device's lowering refuses float16 dots summed in float32 (a tiny probe,
    lowered once per process)."""
    matrix = jax.ShapeDtypeStruct((2, 2), jnp.float16)

    def dot(lhs: Any, rhs: Any) -> Any:
        return jax.lax.dot(
            lhs,
            rhs,
            precision=jax.lax.DotAlgorithmPreset.F16_F16_F32,
            preferred_element_type=jnp.float32,
        )

    try:
        jax.jit(dot).lower(matrix, matrix)
    except ValueError as error:
        if _NO_FLOAT16_SUMS in str(error):
            return True
        raise
    return False


def _state(model: keras.Model) -> tuple[list[Any], ...]:
    """The state Keras' JAX trainer passes its jitted train step."""
    return (
        [variable.value for variable in model.trainable_variables],
        [variable.value for variable in model.non_trainable_variables],
        [variable.value for variable in model.optimizer.variables],
        [variable.value for variable in model.metrics_variables],
    )


def compiled_gradients(loss: Callable[..., Any]) -> Callable[..., Any]:
    """`loss`'s gradients for each of its arguments, XLA-compiled (`jax.jit(jax.grad)`)."""
    return jax.jit(lambda *args: jax.grad(loss, argnums=tuple(range(len(args))))(*args))
