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


def backward_scope() -> Callable[[], contextlib.AbstractContextManager]:
    """Called in a custom gradient's forward: what its backward enters so that the ops it
    makes carry the forward's name scopes as autodiff's do (TensorFlow puts a custom
    gradient's at the graph's root; JAX keeps them already)."""
    if is_jax():
        return contextlib.nullcontext
    from mpt_keras.backend.tensorflow.gradients import gradient_tape_scope

    return gradient_tape_scope()
