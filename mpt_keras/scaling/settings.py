"""The settings of dynamic loss scaling, checked whole; imports no TensorFlow.

`LossScaleSettings` is what `LossScaleOptimizer` is built with (and what its
config holds), and what a run config's `loss_scale` section is checked as
before anything runs. One home for the defaults, the allowed values and their
error messages.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np

from mpt_keras.errors import UserInputError

# The scale lives in a float32 variable: a bound outside this range would
# round to 0 or inf, which is exactly what the bounds exist to prevent.
SCALE_LOW = float(np.finfo(np.float32).tiny)
SCALE_HIGH = float(np.finfo(np.float32).max)
ALL_REDUCE_DTYPES = (None, "float32", "bfloat16", "float16")
DEFAULT_GROWTH_INTERVAL = 2000


@dataclasses.dataclass(frozen=True)
class LossScaleSettings:
    """How the loss scale moves (see `LossScaleOptimizer` for the dynamics).

    Attributes:
        initial_scale: Starting loss scale, in `[min_scale, max_scale]`.
        growth_factor: Factor (> 1) applied after `growth_interval` finite steps.
        backoff_factor: Factor in (0, 1) applied on an overflow.
        growth_interval: Consecutive finite steps (int >= 1) between growths
            (Keras calls it `dynamic_growth_steps`).
        hysteresis: Overflows since the last growth (int >= 1) before the scale
            backs off.
        min_scale: Lower bound of the scale (> 0).
        max_scale: Upper bound of the scale (finite float32).
        dynamic: If False, the scale stays at `initial_scale`.
        all_reduce_dtype: The dtype of the cross-replica gradient sum: `None`
            (the gradients' own), `"float32"`, `"bfloat16"` or `"float16"`.

    Raises:
        UserInputError: A value outside what is allowed, named with it.
    """

    initial_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    dynamic: bool = True
    all_reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        # In order: later checks compare values that earlier checks proved numbers.
        a_scale = f"a positive finite float32 number (in [{SCALE_LOW:.4g}, {SCALE_HIGH:.4g}])"
        low, high = self.min_scale, self.max_scale
        checks = [
            ("initial_scale", _is_scale, a_scale),
            ("min_scale", _is_scale, a_scale),
            ("max_scale", _is_scale, a_scale),
            ("max_scale", lambda v: v >= low, f">= min_scale={low}"),
            (
                "initial_scale",
                lambda v: low <= v <= high,
                f"in [min_scale, max_scale] = [{low}, {high}]",
            ),
            (
                "growth_factor",
                lambda v: _is_number(v) and 1 < v <= SCALE_HIGH,
                "a finite number > 1",
            ),
            (
                "backoff_factor",
                lambda v: _is_number(v) and 0 < v < 1,
                "in the open interval (0, 1)",
            ),
            ("growth_interval", _is_count, "an integer >= 1"),
            ("hysteresis", _is_count, "an integer >= 1"),
            ("dynamic", lambda v: isinstance(v, bool), "True or False"),
            (
                "all_reduce_dtype",
                lambda v: v in ALL_REDUCE_DTYPES,
                "None, 'float32', 'bfloat16' or 'float16'",
            ),
        ]
        for name, is_valid, allowed in checks:
            value = getattr(self, name)
            if not is_valid(value):
                raise UserInputError(
                    f"Argument {name} must be {allowed}. Received: {name}={value!r}"
                )


def growth_interval(growth_interval: int | None, dynamic_growth_steps: int | None) -> Any:
    """One growth interval from our argument and Keras' name for it.

    Raises:
        UserInputError: Both are given and differ.
    """
    if growth_interval is None:
        return DEFAULT_GROWTH_INTERVAL if dynamic_growth_steps is None else dynamic_growth_steps
    if dynamic_growth_steps is not None and dynamic_growth_steps != growth_interval:
        raise UserInputError(
            "growth_interval and dynamic_growth_steps are one setting (Keras' name for it) and "
            f"differ. Received: growth_interval={growth_interval!r}, "
            f"dynamic_growth_steps={dynamic_growth_steps!r}; give one of them"
        )
    return growth_interval


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_scale(value: Any) -> bool:
    return _is_number(value) and SCALE_LOW <= value <= SCALE_HIGH


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
