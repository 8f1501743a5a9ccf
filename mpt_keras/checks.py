"""Checks of user input: one message form for every number and choice the toolkit takes.

Every refusal reads `{what}: received {value}. Allowed: {allowed}`, so a user learns one form
and a test pins one; `what` names the flag, key or argument as the user wrote it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from typing import Any

from mpt_keras.errors import UserInputError


def refusal(what: str, received: str, allowed: str) -> UserInputError:
    """The one message of bad input; `received` is already written as the user wrote it."""
    return UserInputError(f"{what}: received {received}. Allowed: {allowed}")


def check_number(
    what: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    integer: bool = False,
    unbounded: bool = False,
    show: Callable[[Any], str] = repr,
) -> Any:
    """Returns `value` if it is a finite number (an int if `integer`) in range; else refuses.

    `minimum`, `maximum` are inclusive, `above` exclusive; `unbounded` also takes `inf`, a
    limit that never binds (a threshold off); `show` writes the value (`as_json` for JSON).
    """
    kind = "an integer" if integer else "a number"
    bounds = [
        *([f">= {minimum:g}"] if minimum is not None else []),
        *([f"> {above:g}"] if above is not None else []),
        *([f"<= {maximum:g}"] if maximum is not None else []),
    ]
    allowed = kind + (" " + " and ".join(bounds) if bounds else "")
    if unbounded:
        allowed += " (inf: no limit)"
    numeric = isinstance(value, int) if integer else isinstance(value, (int, float))
    if (
        isinstance(value, bool)
        or not numeric
        or math.isnan(value)
        or (math.isinf(value) and not (unbounded and value > 0))
        or (minimum is not None and value < minimum)
        or (above is not None and value <= above)
        or (maximum is not None and value > maximum)
    ):
        raise refusal(what, show(value), allowed)
    return value


def check_choice(
    what: str, value: Any, choices: Collection[str], show: Callable[[Any], str] = repr
) -> Any:
    """Returns `value` if it is one of `choices`; else refuses, listing them."""
    if not isinstance(value, str) or value not in choices:
        raise refusal(what, show(value), ", ".join(choices))
    return value


def as_json(value: Any) -> str:
    """A received value as it is written in JSON (`show=` for config keys)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def check_batching(
    num_examples: int, num_labels: int, batch_size: int, num_weights: int | None = None
) -> int:
    """Checks in-memory data before it is batched (by tf.data or NumPy), by its counts of
    examples (`data.example_arrays.count`), labels and sample weights if any; returns the
    number of examples."""
    check_number("batch_size", batch_size, minimum=1, integer=True)
    if num_examples == 0:
        raise UserInputError("The dataset has 0 examples. Allowed: at least 1 example.")
    if num_labels != num_examples:
        raise UserInputError(
            f"Got {num_examples} examples but {num_labels} labels. Allowed: one label per example."
        )
    if num_weights is not None and num_weights != num_examples:
        raise UserInputError(
            f"Got {num_examples} examples but {num_weights} sample weights. Allowed: one "
            "sample weight per example."
        )
    return num_examples


def batch_parts(
    features: Any, labels: Any, sample_weight: Any, batch_size: int, count: Callable[[Any], int]
) -> tuple[Any, ...]:
    """What each batch takes the same rows of: `(features, labels[, sample_weight])`, their
    examples counted by `count` and checked (`check_batching`)."""
    weights = () if sample_weight is None else (sample_weight,)
    check_batching(count(features), count(labels), batch_size, *map(count, weights))
    return (features, labels, *weights)
