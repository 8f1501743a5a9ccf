"""Which Keras backend runs, and the few questions whose answer depends on it.

The library asks here, never `keras.backend.backend()` itself, so a new backend is one place
to teach; TensorFlow and JAX are imported only when they are the backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras


def name() -> str:
    """Keras' backend ("tensorflow" or "jax"), as set by `KERAS_BACKEND` before Keras loaded."""
    return keras.backend.backend()


def is_jax() -> bool:
    return name() == "jax"


def is_chief(model: Any) -> bool:
    """Whether this process writes the run's shared files (telemetry, checkpoints) for
    `model`: `tensorflow.workers.is_chief` of its strategy; on JAX, process 0."""
    if is_jax():
        import jax

        return jax.process_index() == 0
    from mpt_keras.backend.tensorflow import workers

    return workers.is_chief(model.distribute_strategy)


def is_traced(value: Any = None) -> bool:
    """Whether code runs in a trace (a `tf.function` graph; a JAX tracer for `value`), where a
    tensor cannot become a Python number."""
    if is_jax():
        from mpt_keras.backend.jax.devices import is_tracer

        return is_tracer(value)
    from mpt_keras.backend.tensorflow.devices import is_tracing

    return is_tracing()


def in_cross_replica_context() -> bool:
    """A `tf.distribute` strategy's cross-replica context (never on JAX)."""
    if is_jax():
        return False
    from mpt_keras.backend.tensorflow.distribute import in_cross_replica_context as cross

    return cross()


def float8_dot(lhs: Any, rhs: Any, contracting: tuple[int, int], dtype: Any) -> Any:
    """`lhs @ rhs` of two float8 matrices over their dimensions `contracting` (one each; the
    result's dimensions are `lhs`'s free one, then `rhs`'s), as float32, for a layer computing
    in `dtype`. JAX hands XLA the float8 values, which its GPU GEMM rewriters need, summed in
    float32 (`backend/jax/float8_dots.py`). TensorFlow has no float8 matmul: it multiplies
    their conversions, exact, to bfloat16 where the layer computes in it (a CPU's bfloat16
    matmul; the sum then rounds to bfloat16 once), else to float32 (a float16 sum of float8
    values overflows)."""
    if is_jax():
        from mpt_keras.backend.jax.float8_dots import float8_dot as jax_float8_dot

        return jax_float8_dot(lhs, rhs, contracting)
    bfloat16 = keras.backend.standardize_dtype(dtype) == "bfloat16"
    wide = "bfloat16" if bfloat16 else "float32"
    lhs, rhs = (keras.ops.cast(matrix, wide) for matrix in (lhs, rhs))
    if contracting[0] == 0:
        lhs = keras.ops.transpose(lhs)
    if contracting[1] == 1:
        rhs = keras.ops.transpose(rhs)
    return keras.ops.cast(keras.ops.matmul(lhs, rhs), "float32")


def backward_scope() -> Callable[[], contextlib.AbstractContextManager]:
    """Called in a custom gradient's forward: what its backward enters so that the ops it
    makes carry the forward's name scopes as autodiff's do (TensorFlow puts a custom
    gradient's at the graph's root; JAX keeps them already)."""
    if is_jax():
        return contextlib.nullcontext
    from mpt_keras.backend.tensorflow.gradients import gradient_tape_scope

    return gradient_tape_scope()
