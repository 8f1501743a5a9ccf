"""Gradient accumulation: the window's finite micro-batches, applied as their mean.

Done by the loss-scale optimizer itself: Keras' own cannot run under MirroredStrategy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
from keras import ops


class Accumulation(NamedTuple):
    """The optimizer variables of the accumulation, and its window."""

    accumulators: list[keras.Variable]  # Per model variable, in the per-variable state's order.
    accumulated: keras.Variable  # The window's finite micro-batches so far.
    micro_batches: keras.Variable  # All micro-batches so far.
    steps: int  # Micro-batches per window.


class Window(NamedTuple):
    """This micro-batch's place in the accumulation window."""

    grads: list[Any]  # The mean of the window's finite micro-batches (float8: largest).
    should_apply: Any  # The window ends and holds a finite micro-batch.
    ends: Any
    updates: list[tuple[keras.Variable, Any]]  # Accumulator and counter updates.


def accumulate(
    accumulation: Accumulation,
    rows: list[int],
    grads: list[Any],
    overwritten: list[bool],
    finite: Any,
) -> Window:
    """Adds a finite micro-batch to the window; `rows`: each gradient's per-variable state row.

    A float8 new value (`overwritten`) keeps the window's largest (its amax, as Keras'
    accumulation), not a sum.
    """
    accumulators = [accumulation.accumulators[row] for row in rows]
    values = [ops.convert_to_tensor(acc) for acc in accumulators]
    grads = [ops.cast(ops.convert_to_tensor(g), acc.dtype) for acc, g in zip(accumulators, grads)]
    sums = [
        ops.where(finite, ops.maximum(acc, g) if o else acc + g, acc)
        for acc, g, o in zip(values, grads, overwritten)
    ]
    count = accumulation.accumulated + ops.cast(finite, accumulation.accumulated.dtype)
    micro_batch = accumulation.micro_batches + 1
    ends = micro_batch % accumulation.steps == 0
    means = [
        s if o else s / ops.cast(ops.maximum(count, 1), s.dtype) for s, o in zip(sums, overwritten)
    ]
    updates = [(acc, ops.where(ends, ops.zeros_like(s), s)) for acc, s in zip(accumulators, sums)]
    updates.append((accumulation.accumulated, ops.where(ends, 0, count)))
    updates.append((accumulation.micro_batches, micro_batch))
    return Window(means, ends & (count > 0), ends, updates)
