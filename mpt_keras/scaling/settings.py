"""The settings of dynamic loss scaling, checked whole; imports no TensorFlow.

`LossScaleSettings` is what `LossScaleOptimizer` is built with and a run config's
`loss_scale` section: one home for defaults and checks.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mpt_keras.checks import check_number, refusal
from mpt_keras.errors import UserInputError

# The scale is a float32 variable: a bound outside would round to 0 or inf.
SCALE_LOW = float(np.finfo(np.float32).tiny)
SCALE_HIGH = float(np.finfo(np.float32).max)
ALL_REDUCE_DTYPES = (None, "float32", "bfloat16", "float16")
DEFAULT_GROWTH_INTERVAL = 2000


@dataclasses.dataclass(frozen=True)
class LossScaleSettings:
    """How the loss scale moves (see `LossScaleOptimizer`); `check_settings` checks it.

    `growth_interval` is Keras' `dynamic_growth_steps`; `hysteresis`: the overflows since the
    last growth that back the scale off; `dynamic=False` pins it at `initial_scale`;
    `all_reduce_dtype`: of the cross-replica gradient sum (None: the gradients').
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
        check_settings(vars(self))


def check_settings(
    values: Mapping[str, Any],
    what: Callable[[str], str] = "Argument {}".format,
    show: Callable[[Any], str] = repr,
) -> None:
    """Checks every field's value of `LossScaleSettings`, given by name; raises
    `UserInputError` at the first one not allowed (later checks compare values that earlier
    ones proved numbers). `what` names a field (a config passes its key); `show` writes a
    received value (`checks.as_json` for JSON)."""
    number = {name: _plain(value) for name, value in values.items()}
    for name in ("initial_scale", "min_scale", "max_scale"):
        check_number(what(name), number[name], minimum=SCALE_LOW, maximum=SCALE_HIGH, show=show)
    low, high, initial = number["min_scale"], number["max_scale"], number["initial_scale"]
    if high < low:
        raise refusal(what("max_scale"), show(high), f"a number >= min_scale ({low})")
    if not low <= initial <= high:
        raise refusal(
            what("initial_scale"),
            show(initial),
            f"a number in [min_scale, max_scale] = [{low}, {high}]",
        )
    check_number(
        what("growth_factor"), number["growth_factor"], above=1, maximum=SCALE_HIGH, show=show
    )
    backoff = number["backoff_factor"]
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 < backoff < 1:
        raise refusal(what("backoff_factor"), show(backoff), "a number > 0 and < 1")
    for name in ("growth_interval", "hysteresis"):
        check_number(what(name), number[name], minimum=1, integer=True, show=show)
    if not isinstance(values["dynamic"], bool):
        raise refusal(what("dynamic"), show(values["dynamic"]), "True or False")
    if values["all_reduce_dtype"] not in ALL_REDUCE_DTYPES:
        raise refusal(
            what("all_reduce_dtype"),
            show(values["all_reduce_dtype"]),
            "None, 'float32', 'bfloat16', 'float16'",
        )


def growth_interval(growth_interval: int | None, dynamic_growth_steps: int | None) -> Any:
    """One growth interval from ours and Keras' name for it; refuses both, differing."""
    if growth_interval is None:
        return DEFAULT_GROWTH_INTERVAL if dynamic_growth_steps is None else dynamic_growth_steps
    if dynamic_growth_steps is not None and dynamic_growth_steps != growth_interval:
        raise UserInputError(
            "growth_interval and dynamic_growth_steps are one setting (Keras' name for it) and "
            f"differ. Received: growth_interval={growth_interval!r}, "
            f"dynamic_growth_steps={dynamic_growth_steps!r}; give one of them"
        )
    return growth_interval


def _plain(value: Any) -> Any:
    """A NumPy scalar as a Python number, which the checks take."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)
