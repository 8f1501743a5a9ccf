"""One step of the loss-scale optimizer: the replica's part, then one cross-replica write.

The write is one `cond` on a verdict every replica shares, so each outcome
(applied, accumulated, skipped) writes only what it changes.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
from keras import ops

from mpt_keras import compat
from mpt_keras.backend.tensorflow.cross_replica import Writer, all_reduce_gradients, first_replica
from mpt_keras.backend.tensorflow.distribute import current_strategy
from mpt_keras.backend.tensorflow.step_verdict import batch_verdict, judge_gradients, unscale
from mpt_keras.precision.float8 import is_float8_state
from mpt_keras.scaling import scale_rule
from mpt_keras.scaling.accumulation import accumulate
from mpt_keras.scaling.health import BAD_BATCH_MEMORY
from mpt_keras.scaling.inner_update import apply_inner, skip_inner
from mpt_keras.scaling.own_variables import (
    OwnVariables,
    spread_over,
)
from mpt_keras.scaling.step_record import StepRecord

# Ours (not imported: it imports this module); read: settings, `dynamic_scale`, the inner.
_Optimizer = keras.optimizers.LossScaleOptimizer

compat.install()  # `gradients_already_reduced`, for `inner_update.apply_inner`.


def run_step(
    optimizer: _Optimizer,
    own: OwnVariables,
    grads: list[Any],
    variables: list[keras.Variable],
    loss: Any | None,
    batch: Any,
    state: list[tuple[keras.Variable, Any]],
    unscaled: bool,
) -> Any:
    """The replica's part (all-reduce, unscale, judge), then the merged write; the bad batch.

    `unscaled`: the gradients are not scaled (by the caller's `get_unscaled_gradients`, or
    of a loss never scaled): nothing is divided."""
    checked_batch = loss is not None or batch is not None
    if checked_batch:
        bad_batch, loss = batch_verdict(loss, batch)
    else:
        bad_batch, loss = ops.convert_to_tensor(False), ops.zeros((), "float32")
    # Float8 scales and amax histories get their new value as "gradient": never unscaled.
    overwritten = [is_float8_state(v) for v in variables]
    # Reduced first: verdict, clipping and state updates then agree on all replicas.
    grads = all_reduce_gradients(grads, overwritten, optimizer.all_reduce_dtype)
    if not (unscaled or scale_rule.scale_is_one(optimizer)):
        scale = ops.convert_to_tensor(optimizer.dynamic_scale)
        grads = [g if o else unscale(g, scale) for g, o in zip(grads, overwritten)]
    verdict = judge_gradients(grads, overwritten, bad_batch)
    should_apply, step_ends, updates = verdict.finite, ops.convert_to_tensor(True), []
    if own.accumulation is not None:
        rows = [own.model.position(v) for v in variables]
        window = accumulate(own.accumulation, rows, grads, overwritten, verdict.finite)
        grads, should_apply, step_ends, updates = (
            window.grads,
            window.should_apply,
            window.ends,
            window.updates,
        )
    record = StepRecord(
        grads=grads,
        accumulated=[value for _, value in updates],
        state=[value for _, value in state],
        should_apply=should_apply,
        step_ends=step_ends,
        finite=verdict.finite,
        halves=verdict.halves,
        new_values_finite=verdict.new_values_finite,
        bad_batch=bad_batch,
        loss=loss,
        half_total=verdict.half_total,
    )
    write_step = functools.partial(
        _write_step,
        optimizer=optimizer,
        own=own,
        variables=variables,
        # Which variables overflowed is worked out only when a step is skipped.
        rows=[own.model.position(variables[i]) for i in verdict.order],
        accumulated_variables=[v for v, _ in updates],
        state_variables=[v for v, _ in state],
        checked_batch=checked_batch,
    )
    compat.maybe_merge_call(write_step, current_strategy(), record)
    return bad_batch


def _write_step(
    distribution: Any,
    record: StepRecord,
    *,
    optimizer: _Optimizer,
    own: OwnVariables,
    variables: list[keras.Variable],
    rows: list[int],
    accumulated_variables: list[keras.Variable],
    state_variables: list[keras.Variable],
    checked_batch: bool,
) -> None:
    """Writes the step in the cross-replica context, where a cond may write mirrored variables;
    `rows`: the state rows of the judged gradients, then of the float8 new values."""
    record = record.shared(functools.partial(first_replica, distribution))
    write = Writer(distribution)
    dynamic = optimizer.dynamic

    def count_skip(nonfinite: Any, overflow: Any) -> None:
        for variable, value in zip(state_variables, record.state):
            write.assign(variable, value)  # Each replica its own value.
        write.add(own.skipped, 1)
        write.add(own.nonfinite, ops.cast(nonfinite, "int64"))
        if checked_batch:
            _record_bad_batch(write, optimizer, own, record.bad_batch, record.loss)
        if dynamic:
            back_off = functools.partial(
                scale_rule.back_off,
                write,
                own.scale,
                backoff_factor=optimizer.backoff_factor,
                hysteresis=optimizer.hysteresis,
                min_scale=optimizer.min_scale,
            )
            ops.cond(overflow, back_off, lambda: None)

    def count_finite() -> None:
        if checked_batch:
            write.assign(own.last_loss, record.loss)
        if dynamic:
            scale_rule.count_finite_step(
                write,
                own.scale,
                growth_factor=optimizer.growth_factor,
                growth_interval=optimizer.growth_interval,
                max_scale=optimizer.max_scale,
            )

    def count_nonfinite() -> None:
        # A bad batch is not an overflow: no attribution, no change of the scale.
        finite = [ops.isfinite(half) for half in record.halves] + record.new_values_finite
        nonfinite = spread_over(~ops.stack(finite), rows, len(own.model.variables))
        count_skip(nonfinite & ~record.bad_batch, ~record.bad_batch)

    def judge() -> None:
        ops.cond(record.finite, count_finite, count_nonfinite)

    def apply() -> None:
        inner = optimizer.inner_optimizer
        updated_nonfinite = apply_inner(distribution, inner, record.grads, variables, own.model)
        if own.accumulation is not None:
            judge()  # The window's last micro-batch may be the non-finite one.
        elif updated_nonfinite is None:
            count_finite()
        else:
            ops.cond(
                ops.any(updated_nonfinite),
                lambda: count_skip(updated_nonfinite, ops.convert_to_tensor(True)),
                count_finite,
            )

    def do_not_apply() -> None:
        skip_inner(write, optimizer.inner_optimizer, record.step_ends)
        if own.accumulation is not None:
            judge()  # A finite micro-batch inside the window, or a skipped one.
        else:
            count_nonfinite()

    compat.called_cond(record.should_apply, apply, do_not_apply)
    write.assign(own.half_squared_norm, record.half_total)
    for variable, value in zip(accumulated_variables, record.accumulated):
        write.assign(variable, value)


def _record_bad_batch(
    write: Writer, optimizer: _Optimizer, own: OwnVariables, bad_batch: Any, loss: Any
) -> None:
    """On a skipped step: its loss if its batch was good, its step if bad."""
    count = own.bad_batches
    if own.accumulation is not None:
        step = own.accumulation.micro_batches + 1  # Written after this.
    else:
        step = ops.cast(optimizer.inner_optimizer.iterations, "int64")  # Advanced already.
    slot = ops.arange(BAD_BATCH_MEMORY, dtype="int64") == count % BAD_BATCH_MEMORY
    write.assign(own.last_loss, ops.where(bad_batch, own.last_loss, loss))
    write.assign(own.bad_batch_ring, ops.where(bad_batch & slot, step, own.bad_batch_ring))
    write.add(count, ops.cast(bad_batch, "int64"))
