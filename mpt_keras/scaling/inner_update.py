"""The inner optimizer's update: run on the summed gradients, undone if it overflowed, or skipped.

With float16 or bfloat16 variables a finite gradient can still write an Inf; that update is undone.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from mpt_keras import compat
from mpt_keras.backend.tensorflow.cross_replica import Writer
from mpt_keras.backend.tensorflow.distribute import in_cross_replica_context
from mpt_keras.backend.tensorflow.values import copied_value
from mpt_keras.scaling.own_variables import ModelVariables, spread_over


def apply_inner(
    distribution: Any,  # A tf.distribute.Strategy.
    inner: keras.optimizers.Optimizer,
    grads: list[Any],
    variables: list[keras.Variable],
    model: ModelVariables,
) -> Any:
    """Runs `inner.apply()` in the cross-replica context. With low-precision variables,
    returns per built variable whether the update went non-finite and was undone (a slot's
    overflow blames every checked variable); else None."""
    restored = model.update_restored
    before = [copied_value(v) for v in restored] if restored else []
    with compat.gradients_already_reduced():
        if in_cross_replica_context():
            distribution.extended.call_for_each_replica(inner.apply, args=(grads, variables))
        else:  # No strategy: maybe_merge_call stayed in the replica context.
            inner.apply(grads, variables)
    if not restored:
        return None
    checked_variables = model.update_checked
    checked = ops.stack([~ops.all(ops.isfinite(v)) for v in checked_variables])
    slots = restored[len(checked_variables) :]
    slots_nonfinite = ops.any(ops.stack([~ops.all(ops.isfinite(v)) for v in slots] or [False]))
    positions = [model.position(v) for v in checked_variables]
    per_variable = spread_over(checked | slots_nonfinite, positions, len(model.variables))
    write = Writer(distribution)

    def restore() -> None:
        for variable, value in zip(restored, before):
            write.assign(variable, value)

    ops.cond(ops.any(per_variable), restore, lambda: None)
    return per_variable


def skip_inner(write: Writer, inner: keras.optimizers.Optimizer, step_ends: Any) -> None:
    """Advances the inner optimizers' `iterations` as their `apply()` would (at a window's end)."""
    counters = [inner.iterations] + [
        sub.iterations for sub in getattr(inner, "optimizers", ()) if sub.built
    ]
    for counter in counters:
        write.add(counter, ops.cast(step_ends, counter.dtype))
