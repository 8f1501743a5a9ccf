"""The optimizer's scalars the monitor writes beside the step logs, on every backend."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import keras
from keras import ops

from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry import layout as tags


def optimizer_scalars(optimizer: keras.optimizers.Optimizer, present: Collection[str]) -> dict:
    """The optimizer's scalars not in `present` (a custom loop logs none); tensors read in the
    caller's graph, or eagerly."""
    scalars: dict[str, Any] = {"learning_rate": optimizer.learning_rate}
    if isinstance(optimizer, LossScaleOptimizer):
        readers = {
            tags.LOSS_SCALE: lambda: optimizer.loss_scale,
            tags.SKIPPED_STEPS: lambda: ops.cast(optimizer.skipped_steps, "float32"),
            tags.GRADIENT_NORM: lambda: optimizer.gradient_norm,
        }
        scalars.update({tag: read() for tag, read in readers.items() if tag not in present})
    return scalars


def add_optimizer_scalars(
    optimizer: keras.optimizers.Optimizer, scalars: dict[str, Any], interval: Any
) -> Any:
    """Adds to `scalars` the optimizer's scalars it lacks and the overflow rate of `interval`
    (`(skipped before it, its steps)`); returns the skipped steps, None without loss scaling.
    A summary writer's `extend`: in its trace on TensorFlow, eagerly on JAX."""
    scalars.update(optimizer_scalars(optimizer, scalars))
    skipped = scalars.get(tags.SKIPPED_STEPS)
    if skipped is not None:
        skipped_before, steps = interval[0], interval[1]
        scalars[tags.OVERFLOW_RATE] = (skipped - skipped_before) / steps
    return skipped
