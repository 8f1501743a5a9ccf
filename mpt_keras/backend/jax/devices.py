"""JAX's view of the machine's accelerators and of tracing."""

from __future__ import annotations

from typing import Any

import jax
import keras


def accelerators() -> tuple[tuple[tuple[int, int], ...], bool]:
    """`(GPU compute capabilities, whether a TPU is present)`, from `jax.devices()` (which
    starts JAX's runtime: XLA flags are set before)."""
    devices = jax.devices()
    capabilities = tuple(
        _major_minor(getattr(device, "compute_capability", "0.0"))
        for device in devices
        if device.platform == "gpu"
    )
    return capabilities, any(device.platform == "tpu" for device in devices)


def is_tracer(value: Any) -> bool:
    """Whether `value` is a JAX tracer, which has no value."""
    return isinstance(value, jax.core.Tracer)


def trace_without_running(function: Any, inputs: Any) -> None:
    """Traces `function(inputs)` with `jax.eval_shape` (a batch of 1 where the size is open)."""
    shapes = keras.tree.map_structure(
        lambda v: jax.ShapeDtypeStruct(
            tuple(d or 1 for d in v.shape), keras.backend.standardize_dtype(v.dtype)
        ),
        inputs,
    )
    jax.eval_shape(function, shapes)


def _major_minor(capability: str) -> tuple[int, int]:
    """`"9.0"` -> `(9, 0)`; `(0, 0)` when unreported (as TensorFlow's probe)."""
    major, _, minor = str(capability).partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() else (0, 0)
