"""One loss-scaling step as a function of values: what Keras' JAX trainer calls.

The TensorFlow step (`step`) writes variables inside a cross-replica `cond`. A traced JAX
step has no variables to write, so here every outcome is a value: the inner update runs under
one `cond` (its new values, or the old ones with `iterations` advanced), and the counters and
the scale are chosen with `where`. The rules are `step`'s, outcome for outcome. Under
`keras.distribution.DataParallel` the gradients a jitted step sees are already global, so the
verdict is too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from mpt_keras.checks import refusal
from mpt_keras.precision.float8 import is_float8_state
from mpt_keras.scaling import scale_rule
from mpt_keras.scaling.accumulation import accumulate
from mpt_keras.scaling.health import BAD_BATCH_MEMORY
from mpt_keras.scaling.own_variables import (
    OwnVariables,
    spread_over,
)

# Ours (not imported: it imports this module); read: settings, `dynamic_scale`, the inner.
_Optimizer = keras.optimizers.LossScaleOptimizer


def stateless_step(
    optimizer: _Optimizer,
    own: OwnVariables,
    optimizer_values: Sequence[Any],
    grads: Sequence[Any],
    trainable_values: Sequence[Any],
    *,
    loss: Any = None,
    batch: Any = None,
    unscaled: bool = False,
) -> tuple[list[Any], list[Any]]:
    """The new trainable and optimizer values (in `optimizer.variables`' order) of one step;
    `unscaled` as in `step.run_step`."""
    variables = list(own.model.variables)
    mapping = [*zip(optimizer.variables, optimizer_values), *zip(variables, trainable_values)]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        trainable, inner = _step(
            optimizer, own, list(grads), list(trainable_values), loss, batch, unscaled
        )
        new_values = []
        for variable, value in zip(optimizer.variables, optimizer_values):
            current = scope.get_current_value(variable)
            new_values.append(value if current is None else current)
    positions = {id(v): i for i, v in enumerate(optimizer.variables)}
    for variable, value in inner:
        new_values[positions[id(variable)]] = value
    return trainable, new_values


def apply_eagerly(
    optimizer: _Optimizer,
    own: OwnVariables,
    grads: list[Any],
    variables: list[keras.Variable],
    loss: Any,
    batch: Any,
    state: list[tuple[keras.Variable, Any]],
    unscaled: bool,
) -> Any:
    """`apply()` on JAX: one step on the variables' values, written back (`state` put back
    on a skip); returns whether the step was a bad batch."""
    built = list(own.model.variables)
    if [id(v) for v in variables] != [id(v) for v in built]:
        raise refusal(
            "On Keras' JAX backend, apply()'s variables",
            f"{len(variables)} variables",
            f"the {len(built)} variables the optimizer was built on, in their order",
        )
    before = [ops.convert_to_tensor(v) for v in optimizer.variables]
    trainable, values = stateless_step(
        optimizer,
        own,
        before,
        grads,
        [ops.convert_to_tensor(v) for v in variables],
        loss=loss,
        batch=batch,
        unscaled=unscaled,
    )
    for variable, value in zip([*variables, *optimizer.variables], [*trainable, *values]):
        variable.assign(value)
    skipped = step_skipped(optimizer, own, before, values)
    for variable, value in state:
        variable.assign(ops.where(skipped, value, ops.convert_to_tensor(variable)))
    return step_skipped(optimizer, own, before, values, bad_batch=True)


def step_skipped(
    optimizer: _Optimizer,
    own: OwnVariables,
    old: Sequence[Any],
    new: Sequence[Any],
    bad_batch: bool = False,
) -> Any:
    """Whether the step from optimizer values `old` to `new` was skipped (with `bad_batch`:
    as a bad batch), a bool tensor."""
    at = _position(optimizer, own.bad_batches if bad_batch else own.skipped)
    return new[at] > old[at]


def _position(optimizer: _Optimizer, variable: keras.Variable) -> int:
    """`variable`'s index in `optimizer.variables`, the order of the values a step takes."""
    return next(i for i, v in enumerate(optimizer.variables) if v is variable)


def _step(
    optimizer: _Optimizer,
    own: OwnVariables,
    grads: list[Any],
    trainable: list[Any],
    loss: Any,
    batch: Any,
    unscaled: bool,
) -> tuple[list[Any], list[tuple[keras.Variable, Any]]]:
    """Writes our variables in the scope; returns the trainable and inner optimizer values."""
    model = own.model
    variables = list(model.variables)
    checked_batch = loss is not None or batch is not None
    bad_batch, loss = _batch_verdict(loss, batch)
    overwritten = [is_float8_state(v) for v in variables]
    if not (unscaled or scale_rule.scale_is_one(optimizer)):
        scale = ops.convert_to_tensor(optimizer.dynamic_scale)
        grads = [g if o else ops.divide(g, scale) for g, o in zip(grads, overwritten)]
    judged = [i for i, o in enumerate(overwritten) if not o]
    halves = [ops.sum(ops.square(ops.cast(grads[i], "float32"))) / 2 for i in judged]
    half_total = ops.sum(ops.stack(halves)) if halves else ops.zeros(())
    new_finite = [ops.all(ops.isfinite(g)) for g, o in zip(grads, overwritten) if o]
    finite = ops.isfinite(half_total) & ~bad_batch
    if new_finite:
        finite &= ops.all(ops.stack(new_finite))
    should_apply, step_ends = finite, ops.convert_to_tensor(True)
    if own.accumulation is not None:
        rows = [model.position(v) for v in variables]
        window = accumulate(own.accumulation, rows, grads, overwritten, finite)
        grads, should_apply, step_ends = window.grads, window.should_apply, window.ends
        for variable, value in window.updates:
            variable.assign(value)
    trainable, inner, undone = _inner_update(
        optimizer.inner_optimizer, model, grads, trainable, should_apply, step_ends
    )
    # The outcome, as `step._write_step` reaches it.
    order = judged + [i for i, o in enumerate(overwritten) if o]
    flags = ~ops.stack([ops.isfinite(h) for h in halves] + new_finite)
    nonfinite = spread_over(flags, [model.position(variables[i]) for i in order], len(variables))
    if own.accumulation is not None:
        finite_step = finite
        nonfinite, overflow = nonfinite & ~bad_batch, ~bad_batch
    else:
        applied = should_apply
        finite_step = applied & ~ops.any(undone)
        nonfinite = ops.where(applied, undone, nonfinite & ~bad_batch)
        overflow = applied | ~bad_batch
    skipped = ~finite_step
    count_type = own.skipped.dtype  # int64, or int32 where JAX runs without x64.
    own.skipped.assign(own.skipped + ops.cast(skipped, count_type))
    own.nonfinite.assign(own.nonfinite + ops.cast(nonfinite & skipped, count_type))
    if checked_batch:
        bad = skipped & bad_batch
        if own.accumulation is not None:
            step = ops.convert_to_tensor(own.accumulation.micro_batches)  # Advanced already.
        else:
            iterations = optimizer.inner_optimizer.iterations
            step = dict((id(v), x) for v, x in inner)[id(iterations)]
        count = ops.convert_to_tensor(own.bad_batches)
        slot = ops.arange(BAD_BATCH_MEMORY, dtype=count_type) == count % BAD_BATCH_MEMORY
        ring = own.bad_batch_ring
        ring.assign(ops.where(bad & slot, ops.cast(step, count_type), ops.convert_to_tensor(ring)))
        own.bad_batches.assign(count + ops.cast(bad, count_type))
        own.last_loss.assign(ops.where(bad, ops.convert_to_tensor(own.last_loss), loss))
    if optimizer.dynamic:
        _move_scale(optimizer, own, finite_step, skipped & overflow)
    own.half_squared_norm.assign(half_total)
    return trainable, inner


def _batch_verdict(loss: Any, batch: Any) -> tuple[Any, Any]:
    """Whether the batch (or, without one, the loss) holds a NaN or Inf; and the summed loss."""
    loss = ops.cast(ops.zeros(()) if loss is None else loss, "float32")
    if batch is None:
        return ops.any(ops.isnan(loss)), ops.sum(loss)
    flags = [
        ~ops.all(ops.isfinite(value))
        for value in keras.tree.flatten(batch)
        if value is not None
        and keras.backend.is_float_dtype(keras.backend.standardize_dtype(value.dtype))
    ]
    return ops.any(ops.stack(flags)) if flags else ops.convert_to_tensor(False), ops.sum(loss)


def _inner_update(
    inner: keras.optimizers.Optimizer,
    model: Any,
    grads: list[Any],
    trainable: list[Any],
    should_apply: Any,
    step_ends: Any,
) -> tuple[list[Any], list[tuple[keras.Variable, Any]], Any]:
    """The inner update under one `cond`: applied (undone where low-precision values went
    non-finite), or skipped with `iterations` advanced as `apply()` would. Returns the
    trainable values, the inner variables' values and, per built variable, what was undone."""
    inner_variables = list(inner.variables)
    old_inner = [ops.convert_to_tensor(v) for v in inner_variables]
    counters = {id(inner.iterations)} | {
        id(sub.iterations) for sub in getattr(inner, "optimizers", ()) if sub.built
    }
    count = len(model.variables)

    def apply() -> tuple[list[Any], list[Any], Any]:
        new_trainable, new_inner = inner.stateless_apply(old_inner, grads, trainable)
        if not model.update_checked:
            return new_trainable, new_inner, ops.zeros((count,), "bool")
        new = {
            id(v): x
            for v, x in zip([*model.variables, *inner_variables], [*new_trainable, *new_inner])
        }
        checked = ops.stack([~ops.all(ops.isfinite(new[id(v)])) for v in model.update_checked])
        slots = model.update_restored[len(model.update_checked) :]
        slots_bad = ops.any(
            ops.stack([~ops.all(ops.isfinite(new[id(v)])) for v in slots] or [False])
        )
        positions = [model.position(v) for v in model.update_checked]
        undone = spread_over(checked | slots_bad, positions, count)
        restored = {id(v) for v in model.update_restored}
        back = ops.any(undone)

        def kept(pairs: list[tuple[keras.Variable, Any, Any]]) -> list[Any]:
            return [ops.where(back, old, x) if id(v) in restored else x for v, old, x in pairs]

        return (
            kept(list(zip(model.variables, trainable, new_trainable))),
            kept(list(zip(inner_variables, old_inner, new_inner))),
            undone,
        )

    def skip() -> tuple[list[Any], list[Any], Any]:
        advanced = [
            x + ops.cast(step_ends, x.dtype) if id(v) in counters else x
            for v, x in zip(inner_variables, old_inner)
        ]
        return list(trainable), advanced, ops.zeros((count,), "bool")

    new_trainable, new_inner, undone = ops.cond(should_apply, apply, skip)
    return list(new_trainable), list(zip(inner_variables, new_inner)), undone


def _move_scale(optimizer: _Optimizer, own: OwnVariables, finite: Any, overflow: Any) -> None:
    """`scale_rule`'s growth on a finite step and backoff on an overflow, as values."""
    scale, finite_steps, overflows = (ops.convert_to_tensor(v) for v in own.scale)
    grows = finite & (finite_steps + 1 >= optimizer.growth_interval)
    counted = ops.minimum(overflows + 1, optimizer.hysteresis)
    backs_off = overflow & (counted >= optimizer.hysteresis)
    grown = ops.minimum(scale * optimizer.growth_factor, optimizer.max_scale)
    backed_off = ops.maximum(scale * optimizer.backoff_factor, optimizer.min_scale)
    own.scale.scale.assign(ops.where(grows, grown, ops.where(backs_off, backed_off, scale)))
    zero = ops.zeros_like(finite_steps)
    own.scale.finite_steps.assign(
        ops.where(
            finite & ~grows, finite_steps + 1, ops.where(grows | overflow, zero, finite_steps)
        )
    )
    own.scale.overflows.assign(
        ops.where(grows, ops.zeros_like(overflows), ops.where(overflow, counted, overflows))
    )
