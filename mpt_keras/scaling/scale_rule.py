"""How the loss scale moves: growth after a run of finite steps, backoff with hysteresis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import keras
from keras import ops

if TYPE_CHECKING:
    from mpt_keras.backend.tensorflow.cross_replica import Writer


class ScaleVariables(NamedTuple):
    """The optimizer variables the rule reads and writes."""

    scale: keras.Variable
    finite_steps: keras.Variable  # Finite steps since the last growth or overflow.
    overflows: keras.Variable  # Overflows since the last growth, saturating at hysteresis.


def count_finite_step(
    write: Writer,
    variables: ScaleVariables,
    *,
    growth_factor: float,
    growth_interval: int,
    max_scale: float,
) -> None:
    """A finite step: the scale grows after `growth_interval` of them in a row."""
    scale, finite_steps, overflows = variables

    def grow() -> None:
        write.assign(scale, ops.minimum(scale * growth_factor, max_scale))
        write.assign(finite_steps, 0)
        write.assign(overflows, 0)

    ops.cond(finite_steps + 1 >= growth_interval, grow, lambda: write.add(finite_steps, 1))


def back_off(
    write: Writer,
    variables: ScaleVariables,
    *,
    backoff_factor: float,
    hysteresis: int,
    min_scale: float,
) -> None:
    """An overflow: from the `hysteresis`-th since the last growth on, the scale backs off."""
    scale, finite_steps, overflows = variables
    counted = ops.minimum(overflows + 1, hysteresis)
    backed_off = ops.maximum(scale * backoff_factor, min_scale)
    write.assign(scale, ops.where(counted >= hysteresis, backed_off, scale))
    write.assign(finite_steps, 0)
    write.assign(overflows, counted)


def scale_is_one(optimizer: Any) -> bool:
    """The scale is pinned at 1 (bfloat16 and float32 runs): nothing to unscale."""
    return not optimizer.dynamic and optimizer.initial_scale == 1.0


def clamped(scale: float, min_scale: float, max_scale: float) -> float:
    """`scale` within `[min_scale, max_scale]` (a loaded stock scale may lie outside)."""
    return min(max(scale, min_scale), max_scale)
