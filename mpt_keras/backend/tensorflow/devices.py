"""TensorFlow's view of the machine's accelerators and of tracing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf


def accelerators() -> tuple[tuple[tuple[int, int], ...], bool]:
    """`(GPU compute capabilities, whether a TPU is present)`, from the physical devices only:
    the runtime stays uninitialised, so logical devices can still be configured."""
    capabilities = tuple(
        tuple(tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0)))
        for gpu in tf.config.list_physical_devices("GPU")
    )
    return capabilities, bool(tf.config.list_physical_devices("TPU"))


def is_tracing() -> bool:
    """Whether code runs in a `tf.function` graph, where a tensor has no value."""
    return not tf.executing_eagerly()


def trace_without_running(function: Callable[..., Any], inputs: Any) -> None:
    """Traces `function(inputs)` as a `tf.function`'s concrete function, from `inputs`' shapes
    and dtypes (tensors or Keras tensors)."""
    specs = keras.tree.map_structure(
        lambda v: tf.TensorSpec(tuple(v.shape), keras.backend.standardize_dtype(v.dtype)), inputs
    )
    tf.function(function).get_concrete_function(specs)


def graph_of_its_own() -> Any:
    """A graph made the default (a `with` block): ops made inside start no runtime."""
    return tf.Graph().as_default()


def replica_device_type(strategy: tf.distribute.Strategy) -> str:
    """`TPU`, `GPU` or `CPU`: where the strategy's replicas compute."""
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:
        # The default strategy names no devices: it runs on the first GPU if any.
        return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    types = {tf.DeviceSpec.from_string(device).device_type for device in devices}
    return next((kind for kind in ("TPU", "GPU") if kind in types), "CPU")
