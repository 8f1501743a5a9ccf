"""Examples held in memory: `x` an array, or a dict of arrays, one per model input.

A keras_hub backbone takes a dict (`token_ids`, `padding_mask`), as does any functional
model with named inputs; on Keras' JAX backend arrays are a run's only data. The first axis of
every array counts the examples; batching takes the same rows of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import numpy as np

from mpt_keras.checks import refusal

Features = Union[np.ndarray, Mapping[str, np.ndarray]]


def count(features: Features) -> int:
    """The number of examples (checked equal across a dict's arrays by `checked`)."""
    if isinstance(features, Mapping):
        return len(next(iter(features.values()), ()))
    return len(features)


def take(features: Features, rows: Any) -> Features:
    """The examples at `rows` (a slice or an index array) of each array."""
    if isinstance(features, Mapping):
        return {name: array[rows] for name, array in features.items()}
    return features[rows]


def checked(x: Any, y: Any, what: str) -> tuple[Features, np.ndarray]:
    """`(x, y)` as NumPy arrays if a run takes them: `x` an array or a non-empty dict of arrays
    named by strings, `y` an array, all of one length; else a one-line `UserInputError`
    (`refusal`)."""
    if isinstance(x, Mapping):
        if not x or not all(isinstance(name, str) for name in x):
            raise refusal(
                f"{what}: x", f"a dict with keys {list(x)!r}",
                "a non-empty dict of arrays keyed by the model's input names",
            )  # fmt: skip
        x = {name: np.asarray(array) for name, array in x.items()}
        lengths = {
            f"x[{name!r}]": _length(array, f"{what}: x[{name!r}]") for name, array in x.items()
        }
    else:
        x = np.asarray(x)
        lengths = {"x": _length(x, f"{what}: x")}
    y = np.asarray(y)
    lengths["y"] = _length(y, f"{what}: y")
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name} {length}" for name, length in lengths.items())
        raise refusal(
            what, f"arrays of lengths {listed}",
            "one length, the number of examples, along the first axis of each",
        )  # fmt: skip
    return x, y


def _length(array: np.ndarray, what: str) -> int:
    if array.ndim == 0:
        raise refusal(what, "a scalar", "an array whose first axis counts the examples")
    return len(array)
