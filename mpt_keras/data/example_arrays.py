"""Examples held in memory: `x` an array, or a dict (by name) or list (by position) of
arrays, one per model input; `y` (and an optional `sample_weight`) an array, or a dict or
list of arrays, one per model output.

A keras_hub backbone takes a dict (`token_ids`, `padding_mask`), as does any functional
model with named inputs; on Keras' JAX backend arrays are a run's only data. The first axis of
every array counts the examples; batching takes the same rows of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import numpy as np

from mpt_keras.checks import refusal

Features = Union[np.ndarray, Mapping[str, np.ndarray], tuple[np.ndarray, ...]]
# Of a long list of lengths, those a message shows.
_LENGTHS_SHOWN = 6


def count(features: Features) -> int:
    """The number of examples (checked equal across a structure's arrays by `checked`)."""
    if isinstance(features, Mapping):
        return len(next(iter(features.values()), ()))
    if isinstance(features, tuple):
        return len(features[0]) if features else 0
    return len(features)


def take(features: Features, rows: Any) -> Features:
    """The examples at `rows` (a slice or an index array) of each array."""
    if isinstance(features, Mapping):
        return {name: array[rows] for name, array in features.items()}
    if isinstance(features, tuple):
        return tuple(array[rows] for array in features)
    return features[rows]


def checked(x: Any, y: Any, what: str, sample_weight: Any = None) -> tuple[Features, ...]:
    """`(x, y)`, or `(x, y, sample_weight)` if given, as NumPy arrays if a run takes them: `x`
    an array, a non-empty dict of arrays named by strings or a list of arrays (the model's
    inputs), `y` and `sample_weight` likewise (its outputs), all of one length; else a
    one-line `UserInputError` (`refusal`)."""
    lengths: dict[str, int] = {}
    x = _arrays(x, "x", "input", what, lengths)
    y = _arrays(y, "y", "output", what, lengths)
    weights = ()
    if sample_weight is not None:
        weights = (_arrays(sample_weight, "sample_weight", "output", what, lengths),)
        _check_weights_as_labels(weights[0], y, what)
    if len(set(lengths.values())) > 1:
        shown = [f"{name} {length}" for name, length in lengths.items()]
        if len(shown) > _LENGTHS_SHOWN:
            shown[_LENGTHS_SHOWN:] = [f"... ({len(shown) - _LENGTHS_SHOWN} more)"]
        listed = ", ".join(shown)
        raise refusal(
            what, f"arrays of lengths {listed}",
            "one length, the number of examples, along the first axis of each",
        )  # fmt: skip
    return (x, y, *weights)


def _check_weights_as_labels(weights: Features, y: Features, what: str) -> None:
    """Refuses sample weights by output that are not `y`'s outputs (one array: all of them)."""
    if isinstance(weights, tuple) and not (isinstance(y, tuple) and len(weights) == len(y)):
        outputs = len(y) if isinstance(y, tuple) else "one"
        raise refusal(
            f"{what}: sample_weight", f"a list of {len(weights)} arrays",
            f"one array for every output, or as y is, a list of {outputs}",
        )  # fmt: skip
    keys = sorted(y) if isinstance(y, Mapping) else None
    if isinstance(weights, Mapping) and sorted(weights) != keys:
        raise refusal(
            f"{what}: sample_weight", f"a dict with keys {sorted(weights)!r}",
            "one array for every output, or a dict with the keys of y"
            + ("" if keys is None else f": {keys!r}"),
        )  # fmt: skip


def _arrays(value: Any, name: str, role: str, what: str, lengths: dict[str, int]) -> Features:
    """`value` (`x`, `y` or `sample_weight`) as an array, a dict of them, or a tuple of them
    by position (a list or tuple of arrays, as Keras takes one per input or output; kept a
    tuple, which tf.data takes for a structure where it stacks a list), each one's length in
    `lengths`."""
    if _by_position(value):
        arrays = tuple(np.asarray(array) for array in value)
        places = [(f"{name}[{index}]", array) for index, array in enumerate(arrays)]
    elif isinstance(value, Mapping):
        if not value or not all(isinstance(key, str) for key in value):
            raise refusal(
                f"{what}: {name}", f"a dict with keys {list(value)!r}",
                f"a non-empty dict of arrays keyed by the model's {role} names",
            )  # fmt: skip
        arrays = {key: np.asarray(array) for key, array in value.items()}
        places = [(f"{name}[{key!r}]", array) for key, array in arrays.items()]
    else:
        arrays = np.asarray(value)
        places = [(name, arrays)]
    for place, array in places:
        lengths[place] = _length(array, f"{what}: {place}")
    return arrays


def _length(array: np.ndarray, what: str) -> int:
    if array.ndim == 0:
        raise refusal(what, "a scalar", "an array whose first axis counts the examples")
    return len(array)


def _by_position(value: Any) -> bool:
    """Whether `value` is a list or tuple of arrays (not of numbers: the rows of one array)."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(len(getattr(item, "shape", ())) >= 1 for item in value)
    )
