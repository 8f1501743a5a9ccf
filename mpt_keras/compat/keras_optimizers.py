"""Touches of Keras' optimizers that every backend shares (optimizers.py: TensorFlow's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras


def skip_stock_build(optimizer: keras.optimizers.Optimizer, var_list: Sequence[Any]) -> None:
    """The base `Optimizer.build`, past the stock `LossScaleOptimizer.build` (a second scale)."""
    keras.optimizers.Optimizer.build(optimizer, var_list)


def learning_rate_schedule(optimizer: keras.optimizers.Optimizer) -> Any:
    """The learning rate `optimizer` was given: a schedule itself, not its current value."""
    return optimizer._learning_rate
