"""Timing a compiled model's train steps one way for every JAX benchmark script.

Each step ends on a host value (the loss as a Python float), so a timed step has finished on the
device; the warm-up steps hold the compilation and are not timed. Only Keras is imported here:
the scripts that use it set their backend first.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WARM_UP_STEPS = 2


def timed_train_steps(model: Any, x: Any, y: Any, steps: int) -> dict[str, Any]:
    """`WARM_UP_STEPS` untimed `train_on_batch` steps, then `steps` timed ones: the median and
    each step in milliseconds, and the last step's loss."""
    times, loss = [], float("nan")
    for step in range(WARM_UP_STEPS + steps):
        start = time.perf_counter()
        loss = float(model.train_on_batch(x, y))
        if step >= WARM_UP_STEPS:
            times.append(time.perf_counter() - start)
    return {
        "median_step_ms": statistics.median(times) * 1000,
        "step_ms": [t * 1000 for t in times],
        "final_loss": loss,
    }


def peak_device_bytes() -> int | None:
    """The first JAX device's peak memory in use (None where the device keeps no figures)."""
    import jax

    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
