"""The optimizer's variables beyond its public ones, and the model variables it was built on.

What a step writes and `readings` read, on every backend: no TensorFlow, no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
from keras import ops

from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import is_float8_state
from mpt_keras.scaling.accumulation import Accumulation
from mpt_keras.scaling.scale_rule import ScaleVariables, scale_is_one

_FULL_PRECISION = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class ModelVariables:
    """The model variables the optimizer was built on, and those an update is checked on.

    One object, not list attributes: Keras' tracker would save and load the variables of an
    optimizer's list attributes by position, as its own.
    """

    variables: tuple[keras.Variable, ...]  # In `build`'s order.
    positions: dict[int, int] = dataclasses.field(compare=False)  # id -> per-variable state row.
    update_checked: tuple[keras.Variable, ...]  # Low precision: an update may overflow them.
    update_restored: tuple[keras.Variable, ...]  # Those, float8 state, inner slots: undone.

    @classmethod
    def of(
        cls,
        var_list: Sequence[keras.Variable],
        in_state_order: Sequence[keras.Variable],
        inner: Any,
    ) -> ModelVariables:
        """`var_list` with its per-variable state in `in_state_order`, for `inner` (built)."""
        low_precision = [v for v in var_list if v.dtype not in _FULL_PRECISION]
        return cls(
            variables=tuple(var_list),
            positions={id(v): i for i, v in enumerate(in_state_order)},
            update_checked=tuple(low_precision),
            update_restored=tuple(
                low_precision
                and [
                    *low_precision,
                    *(v for v in var_list if is_float8_state(v)),
                    *(v for v in inner.variables if v.dtype not in ("int32", "int64")),
                ]
            ),
        )

    def position(self, variable: keras.Variable) -> int:
        return self.positions[id(variable)]


class OwnVariables(NamedTuple):
    """The optimizer's variables beyond its public ones: what a step writes, `readings` read."""

    scale: ScaleVariables
    skipped: keras.Variable
    nonfinite: keras.Variable | None  # Per built variable (None before `build`).
    bad_batches: keras.Variable
    bad_batch_ring: keras.Variable
    last_loss: keras.Variable
    half_squared_norm: keras.Variable
    model: ModelVariables | None  # None before `build`.
    accumulation: Accumulation | None


def caller_unscaled(optimizer: Any, unscaled: bool, variables: Sequence[keras.Variable]) -> bool:
    """`unscaled`: whether the caller unscaled the gradients (`get_unscaled_gradients`).

    Raises:
        UserInputError: It did, with a scale other than 1, and a float8 layer's state is
            among `variables`: that divided its new value by the scale too.
    """
    first = next((v for v in variables if is_float8_state(v)), None) if unscaled else None
    if first is not None and not scale_is_one(optimizer):
        raise UserInputError(
            f"variable '{first.path}' is a float8 layer's state, and the gradients "
            "passed to apply were unscaled by get_unscaled_gradients(), which divided "
            "its new value by the loss scale too. Pass the scaled gradients (of "
            "get_scaled_loss or scale_loss) to apply: it unscales all but float8 state"
        )
    return unscaled


def spread_over(flags: Any, positions: list[int], count: int) -> Any:
    """`flags` of the variables at `positions`, spread over all `count` (False elsewhere)."""
    if positions == list(range(count)):
        return flags
    where = dict(zip(positions, range(len(positions))))
    padded = ops.concatenate([flags, ops.zeros((1,), "bool")], axis=0)
    return ops.take(padded, [where.get(i, len(positions)) for i in range(count)])
