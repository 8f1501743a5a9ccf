"""A variant's memory, from TensorFlow's allocator statistics around its first train steps.

Its own module: which allocator keeps statistics, and what they count, is a concern apart.
On Keras' JAX backend the peak is not read: JAX cannot reset a device's peak between variants
(a GPU's `peak_bytes_in_use` is the process's), and a CPU device keeps no statistics.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from mpt_keras.backend import current

_METHOD = (
    "tf.config.experimental.get_memory_info('{device}'), one variant at a time after its "
    "first step, over {steps} train steps: peak_memory_bytes = peak - allocated before the "
    "variant was built, step_memory_bytes = peak - allocated when the steps began; counts "
    "TensorFlow's allocator only (on CPU, every allocation with TF_CPU_ALLOCATOR_USE_BFC={bfc}, "
    "else oneDNN's allocator's of 256 KiB and more): lower bounds. "
    "variable_bytes: exact bytes of the model's and optimizer's variables"
)


def method(device: str | None, steps: int) -> str:
    """How the memory figures were read, for the result's `methods`."""
    if current.is_jax():
        return (
            "peak_memory_bytes, step_memory_bytes not measured: JAX cannot reset a device's "
            "peak between variants. variable_bytes: exact bytes of the model's and optimizer's "
            "variables"
        )
    if not device:
        return "not measured: TensorFlow tracks no device's memory here"
    bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "unset")
    return _METHOD.format(device=device, steps=steps, bfc=bfc)


def memory_device() -> str | None:
    """The device whose allocator statistics the suite reads; None if it tracks none (or on
    JAX)."""
    if current.is_jax():
        return None
    import tensorflow as tf

    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    try:
        tf.config.experimental.get_memory_info(device)
    except ValueError:
        return None
    return device


def current_bytes(device: str | None) -> int:
    """What the allocator of `device` holds now (0 without statistics)."""
    if not device:
        return 0
    import tensorflow as tf

    return tf.config.experimental.get_memory_info(device)["current"]


def step_memory(
    model: keras.Model, iterator: Any, steps: int, device: str | None, memory_before: int
) -> dict[str, int | None]:
    """The allocator's peak over `steps` train steps, without callbacks (the monitor resets
    the statistics): as `peak_bytes` above `memory_before`, and as `step_bytes` above what was
    allocated when the steps began; both None without statistics."""
    if device is None:
        return {"peak_bytes": None, "step_bytes": None}
    import tensorflow as tf

    resident = current_bytes(device)
    tf.config.experimental.reset_memory_stats(device)
    for _ in range(steps):
        logs = model.train_function(iterator)
    float(logs["loss"])
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return {"peak_bytes": peak - memory_before, "step_bytes": peak - resident}


def variable_bytes(model: keras.Model) -> int:
    """The exact bytes of the model's and its optimizer's variables, each counted once."""
    return sum(
        variable.numpy().nbytes
        for variable in {id(v): v for v in (*model.weights, *model.optimizer.variables)}.values()
    )
