"""Dynamic loss scaling that stays correct under tf.distribute, clipping and XLA.

`LossScaleOptimizer` is a drop-in subclass of
`keras.optimizers.LossScaleOptimizer` for the TensorFlow backend. It owns the
loss-scaling part of a step (unscale, the finite verdict, skip or apply, the
scale update) and leaves the update itself to the inner optimizer's own
`apply()`. See the class docstring for what it changes and why.

Why one module (~950 lines): one step is one piece of control flow: the
verdict, the skip or the inner update, the scale, the bad-batch record and the
accumulation window are written together in one cross-replica `cond`, so that
each outcome writes only what it changes (the settings live in
`loss_scale_settings`, the health record in `step_health`, the private Keras
touches in `keras_compat`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from mpt_keras import compat
from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import is_float8_state, largest_range_used
from mpt_keras.scaling import health as tags
from mpt_keras.scaling import settings as loss_scale_settings
from mpt_keras.scaling.health import BAD_BATCH_MEMORY, StepHealth
from mpt_keras.scaling.settings import LossScaleSettings

_StockLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
_FULL_PRECISION = ("float32", "float64")

compat.install()


@keras.saving.register_keras_serializable(package="mpt_keras")
class LossScaleOptimizer(_StockLossScaleOptimizer):
    """Dynamic loss scaling with one verdict for all replicas.

    Wraps `inner_optimizer` like `keras.optimizers.LossScaleOptimizer` (and is
    one, so `model.compile` does not wrap it again). Each step it all-reduces
    the gradients across replicas, unscales them and judges the sum: a
    variable's gradient is non-finite when its float32 sum of squares is (a
    NaN or Inf, or a norm above 1.8e19, whose square would overflow Adam's
    second moment). A finite step runs the inner optimizer's own `apply()` on
    the summed, unscaled gradients, so `MultiOptimizer`, an overridden
    `apply()`, weight decay, EMA, constraints and clipping (of the sum)
    work as without loss scaling; the inner `loss_scale_factor` is taken over
    by the loss scale (set to None), as the stock class does. A non-finite step is
    skipped on every replica, still advances `iterations`, and backs the scale
    off. With float16 or bfloat16 variables, an update that writes an Inf or
    NaN is undone and counted as a skipped overflow.

    The scale grows by `growth_factor` after `growth_interval` finite steps
    and backs off by `backoff_factor` on the `hysteresis`-th overflow since
    the last growth (and every later one), within `[min_scale, max_scale]`;
    `dynamic=False` pins it. A batch holding a NaN or Inf (handed over by the
    train step, see `apply`) is bad data, not an overflow: skipped and counted
    in `bad_batches`, the scale left alone. With `gradient_accumulation_steps`
    on the inner optimizer, this class accumulates the finite micro-batches'
    unscaled gradients and has the inner optimizer apply their mean once per
    window. `all_reduce_dtype` sums the gradients across replicas in bfloat16
    or float16 to halve the bytes on the wire. All state is optimizer
    variables (saved by `model.save` and checkpoints); `health()` reads it.

    A float8 layer's scales and amax histories (Keras' `overwrite_with_gradient`
    variables, see `mpt_keras.precision.float8`) take the values its backward
    pass computed: never unscaled, outside the gradient norm and clipping, the
    largest over the replicas (and over an accumulation window), untouched by
    a skipped step. A NaN or Inf in one is an overflow, as in a gradient: the
    layer's clipping can hide it from every gradient.

    docs/loss_scaling.md has the details, a comparison with Keras 3, tf-keras
    and PyTorch, and the differences from the stock class on purpose. Keras 2
    loops (`get_scaled_loss`, `get_unscaled_gradients`, `apply_gradients`) work
    unchanged. TensorFlow backend only (`stateless_apply` raises).

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        initial_scale, growth_factor, backoff_factor, growth_interval,
            hysteresis, min_scale, max_scale, dynamic, all_reduce_dtype: The
            `LossScaleSettings`, checked there; `growth_interval` is 2000
            unless given (or given as `dynamic_growth_steps`).
        name: Optimizer name.
        dynamic_growth_steps: Keras' name of `growth_interval` (the stock
            class's argument and config key); giving both with different
            values is an error.
        **kwargs: Accepted for deserialization compatibility with the stock
            class only; base optimizer arguments belong on `inner_optimizer`.

    Example:

    >>> import keras, numpy as np
    >>> from mpt_keras.scaling.optimizer import LossScaleOptimizer
    >>> opt = LossScaleOptimizer(keras.optimizers.AdamW(1e-3), growth_interval=2)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=opt, loss="mse")
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
    >>> opt.loss_scale, opt.skipped_steps
    (65536.0, 0)
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int | None = None,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        dynamic: bool = True,
        all_reduce_dtype: str | None = None,
        name: str | None = None,
        dynamic_growth_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer) or isinstance(
            inner_optimizer, _StockLossScaleOptimizer
        ):
            raise UserInputError(
                "Argument inner_optimizer must be a keras.optimizers.Optimizer that is not a "
                f"LossScaleOptimizer. Received: inner_optimizer={inner_optimizer!r}"
            )
        settings = LossScaleSettings(
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=loss_scale_settings.growth_interval(
                growth_interval, dynamic_growth_steps
            ),
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic,
            all_reduce_dtype=all_reduce_dtype,
        )
        # The stock class takes the inner optimizer's loss_scale_factor over
        # (sets it to None, through a MultiOptimizer too): the dynamic scale
        # replaces it, and gradients scaled by the loss scale alone are divided
        # once. Ours does the same, so a stock loop's gradients update alike.
        super().__init__(
            inner_optimizer,
            initial_scale=float(settings.initial_scale),
            dynamic_growth_steps=int(settings.growth_interval),
            name=name,
            **kwargs,
        )
        # This class accumulates micro-batches itself (Keras' accumulation
        # cannot run under MirroredStrategy): it takes the setting over, and
        # the inner optimizer then counts applied updates in `iterations`, as
        # Keras' accumulation does. `get_config` puts it back.
        self._accumulation_steps = inner_optimizer.gradient_accumulation_steps
        inner_optimizer.gradient_accumulation_steps = None
        self.growth_factor = float(settings.growth_factor)
        self.backoff_factor = float(settings.backoff_factor)
        self.growth_interval = int(settings.growth_interval)
        self.hysteresis = int(settings.hysteresis)
        self.min_scale = float(settings.min_scale)
        self.max_scale = float(settings.max_scale)
        self.dynamic = settings.dynamic
        self.all_reduce_dtype = settings.all_reduce_dtype
        # What Keras' train step (or a Keras 2 loop) handed over in this
        # replica's trace before `apply`: the loss given to `scale_loss`, and
        # whether the caller unscaled the gradients itself.
        self._handed_over: dict[tuple[int, int], dict[str, Any]] = {}
        # Made here, not in build(): a scale_loss() traced before the first
        # apply() must read the variable, not bake in initial_scale.
        self.dynamic_scale = self.add_variable(
            shape=(),
            initializer=keras.initializers.Constant(self.initial_scale),
            dtype="float32",
            name="dynamic_scale",
        )
        self.step_counter = self._add_counter("step_counter")
        self._overflow_counter = self._add_counter("overflow_counter")
        self._skipped_counter = self._add_counter("skipped_counter")
        self._bad_batch_counter = self._add_counter("bad_batch_counter")
        # A ring of the latest bad batches' steps (0: empty slot).
        self._bad_batch_ring = self._add_counter("bad_batch_ring", (BAD_BATCH_MEMORY,))
        self._last_loss = self.add_variable(
            shape=(), initializer="zeros", dtype="float32", name="last_loss"
        )
        # Half the squared global norm of the last step's unscaled, all-reduced
        # gradients, before clipping: `gradient_norm` from it, when asked.
        self._half_squared_norm = self.add_variable(
            shape=(), initializer="zeros", dtype="float32", name="half_squared_gradient_norm"
        )

    def _add_counter(self, name: str, shape: tuple[int, ...] = ()) -> keras.Variable:
        return self.add_variable(shape=shape, dtype="int64", name=name)

    def build(self, var_list: Sequence[keras.Variable]) -> None:
        var_list = list(var_list)
        inner = self.inner_optimizer
        inner.build(var_list)
        # Per-variable state in the order of the variables' paths, not of
        # var_list: it is saved and loaded by position, and a loaded float8
        # model lists a layer's float8 state before its kernel.
        in_state_order = sorted(var_list, key=lambda v: getattr(v, "path", v.name))
        self._nonfinite_counter = self._add_counter("nonfinite_counter", (len(var_list),))
        if self._accumulation_steps:
            self._micro_batches = self._add_counter("micro_batches")
            self._accumulated_counter = self._add_counter("accumulated_counter")
            self._accumulators = [
                self.add_variable_from_reference(v, name="accumulated_gradient")
                for v in in_state_order
            ]
        compat.skip_stock_build(self, var_list)
        self._positions = {id(v): i for i, v in enumerate(in_state_order)}
        # With float16 or bfloat16 variables an update can overflow: those
        # variables and every other floating state the update writes (slots,
        # float8 scales and amax histories) are checked after it, and undone.
        low_precision = [v for v in var_list if v.dtype not in _FULL_PRECISION]
        self._built_on = _BuiltOn(
            variables=tuple(var_list),
            in_state_order=tuple(in_state_order),
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

    def load_own_variables(self, store: Any) -> None:
        """Loads the state `save_own_variables` saved, or the stock class's.

        A `.keras` file saved with `keras.optimizers.LossScaleOptimizer` holds
        its four own variables (iterations, learning rate, growth counter,
        scale) and then the inner optimizer's: those load into ours (the
        scale clamped to `[min_scale, max_scale]`), the rest of ours starts
        fresh.
        """
        inner_variables = self.inner_optimizer.variables
        if len(store.keys()) == len(self.variables) or len(store.keys()) != 4 + len(
            inner_variables
        ):
            super().load_own_variables(store)
            return
        self.step_counter.assign(store["2"])
        scale = min(max(float(store["3"][...]), self.min_scale), self.max_scale)
        self.dynamic_scale.assign(scale)
        for i, variable in enumerate(inner_variables):
            variable.assign(store[str(4 + i)])

    @property
    def loss_scale(self) -> float | tf.Tensor:
        """The current loss scale: a float eagerly, a tensor in a graph."""
        return _read(self.dynamic_scale, float)

    @property
    def skipped_steps(self) -> int | tf.Tensor:
        """Steps (micro-batches) skipped: non-finite gradients, updates or batches."""
        return _read(self._skipped_counter, int)

    @property
    def bad_batches(self) -> int | tf.Tensor:
        """Steps skipped because their loss or batch held a NaN or Inf."""
        return _read(self._bad_batch_counter, int)

    @property
    def gradient_norm(self) -> tf.Tensor:
        """The global norm of the last step's unscaled, all-reduced gradients, before clipping.

        Inf or NaN on a step whose gradients overflowed. A tensor (`float()` it
        eagerly), so that a summary in a graph reads the current value.
        """
        return ops.sqrt(2.0 * ops.convert_to_tensor(self._half_squared_norm))

    @property
    def last_loss(self) -> float | tf.Tensor:
        """The loss of the last step whose batch was finite (summed over replicas).

        A loss of several elements (per-example losses given to `scale_loss`)
        counts as their sum, the loss its gradients are of.
        """
        return _read(self._last_loss, float)

    def step_logs(self) -> dict[str, tf.Tensor]:
        """The loss-scaling state after this step, for the logs a train step returns.

        Read in the train step's graph after `apply()`, so each step's Keras
        logs hold that step's values, also where callbacks run behind the
        steps: `loss_scale`, `skipped_steps` and `bad_batches` (since the
        start of training) and `gradient_norm` (this step's), as float32
        scalars; with float8 layers also `float8_range_used`, the largest
        range used of their quantized tensors (`precision.float8.
        largest_range_used`: above 1, one saturates). Both train steps add
        them: Keras' own (through `model.compile`) and
        `mpt_keras.execution.xla.compile_model`'s.
        """
        logs = {
            tags.LOSS_SCALE: ops.convert_to_tensor(self.dynamic_scale),
            tags.SKIPPED_STEPS: ops.cast(self._skipped_counter, "float32"),
            tags.BAD_BATCHES: ops.cast(self._bad_batch_counter, "float32"),
            tags.GRADIENT_NORM: self.gradient_norm,
        }
        if self.built:
            range_used = largest_range_used(self._built_on.variables)
            if range_used is not None:
                logs[tags.FLOAT8_RANGE_USED] = range_used
        return logs

    def health(self) -> StepHealth:
        """Everything the last steps left in this optimizer, read in one record.

        Call eagerly: reading it syncs with the device.
        """
        count = int(self._bad_batch_counter.numpy())
        ring = self._bad_batch_ring.numpy()
        first = max(0, count - BAD_BATCH_MEMORY)
        return StepHealth(
            loss_scale=float(self.dynamic_scale.numpy()),
            skipped_steps=int(self._skipped_counter.numpy()),
            bad_batches=count,
            bad_batch_steps=tuple(int(ring[i % BAD_BATCH_MEMORY]) for i in range(first, count)),
            last_loss=float(self._last_loss.numpy()),
            gradient_norm=float(self.gradient_norm),
            nonfinite_counts=self.nonfinite_counts(),
        )

    def bad_batch_steps(self) -> list[int]:
        """The steps of the latest `BAD_BATCH_MEMORY` bad batches, in order."""
        return list(self.health().bad_batch_steps)

    def nonfinite_counts(self) -> dict[str, int]:
        """Counts, per variable path, the steps whose gradient or update was non-finite.

        Call eagerly: reading the counts syncs with the device.
        """
        if not self.built:
            return {}
        counts = self._nonfinite_counter.numpy()
        return {
            getattr(v, "path", v.name): int(counts[self._positions[id(v)]])
            for v in self._built_on.variables
        }

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """The loss times the scale.

        Keras' train step calls it with the loss before scaling, and the next
        `apply` of the same replica judges that loss: a NaN or Inf makes the
        step a bad batch, not an overflow.
        """
        # A Python number too, and a tensor of any shape, as the stock class takes.
        loss = ops.convert_to_tensor(loss)
        self._hand_over(loss=loss)
        return ops.multiply(loss, ops.cast(self.dynamic_scale, loss.dtype))

    def get_scaled_loss(
        self, loss: tf.Tensor | Callable[[], tf.Tensor]
    ) -> tf.Tensor | Callable[[], tf.Tensor]:
        """Keras 2 (tf-keras) API: the loss times the scale.

        Args:
            loss: A loss tensor, or a callable returning one.

        Returns:
            The scaled loss; for a callable, a callable returning it (read at
            call time), as tf-keras' `LossScaleOptimizer` does.
        """
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Sequence[tf.Tensor | None]) -> list[tf.Tensor | None]:
        """Keras 2 (tf-keras) API: unscales `grads` for a custom loop.

        Each gradient keeps its dtype (a float16 gradient stays float16, as in
        tf-keras; the division is done in float32) and `None` entries stay
        `None`. The next `apply`/`apply_gradients` of the same replica then
        takes its gradients as already unscaled, as in the TF mixed-precision
        guide; they may be transformed (e.g. clipped) in between. It cannot
        tell a float8 layer's new scales and amax histories from gradients and
        would divide them too: with float8 layers, give `apply` the scaled
        gradients instead.
        """
        self._hand_over(unscaled=True)
        return [None if g is None else _unscaled_like(g, self.dynamic_scale) for g in grads]

    def hand_over_batch(self, batch: Any, state: Sequence[keras.Variable] = ()) -> None:
        """Gives the next `apply` of this replica the batch to judge (see `apply`).

        `model.compile` with this optimizer makes the model's train step call
        it (`mpt_keras.scaling.compile_hook`), so a plain `model.compile` tells bad data
        from an overflow as exactly as `mpt_keras.execution.xla.compile_model`.

        Args:
            batch: The step's batch, before the forward pass.
            state: Variables the forward pass updates (a model's
                non-trainable ones: batch-norm statistics): read now, and put
                back if the step is skipped.
        """
        self._hand_over(batch=batch, state=state_before(state))

    def _hand_over(self, **values: Any) -> None:
        key = _replica_trace_key()
        if any(other[0] != key[0] for other in self._handed_over):
            # Left by a trace that never reached `apply` (a `scale_loss` alone):
            # only the current graph's hand-overs are kept.
            self._handed_over = {k: v for k, v in self._handed_over.items() if k[0] == key[0]}
        self._handed_over.setdefault(key, {}).update(values)

    def _take_handed_over(self) -> dict[str, Any]:
        values = self._handed_over.pop(_replica_trace_key(), {})
        graph = _current_graph()
        for name in ("loss", "batch", "state"):
            tensors = keras.tree.flatten(values.get(name))
            if any(getattr(t, "graph", graph) is not graph for t in tensors):
                values.pop(name)  # From another trace (a nested function's graph).
        return values

    def apply(
        self,
        grads: Sequence[tf.Tensor | None],
        trainable_variables: Sequence[keras.Variable] | None = None,
        *,
        loss: tf.Tensor | None = None,
        batch: Any = None,
        state: Sequence[tuple[keras.Variable, tf.Tensor]] | None = None,
    ) -> tf.Tensor:
        """Applies one step: unscale, judge, then the inner `apply()` or a skip.

        Args:
            grads: The gradients of `scale_loss(loss)`, one per variable
                (`None` for a variable without one).
            trainable_variables: The variables; the ones built with if omitted.
            loss: This replica's loss before scaling, if the caller has it
                (Keras' train step hands it over through `scale_loss`
                instead). A NaN or Inf makes the step a bad batch.
            batch: The batch (inputs, labels, sample weights; any nesting),
                judged like the loss: a NaN or Inf in a floating tensor
                makes the step a bad batch.
            state: `state_before(variables)` of the variables the forward
                pass updated (batch-norm statistics), taken before it: put
                back if the step is skipped, so that a bad batch leaves no
                NaN in them.

        Returns:
            Whether the step was a bad batch on any replica (a bool tensor,
            the same on every replica; False when neither a loss nor a batch
            was given or handed over).
        """
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "apply() must be called in a replica context, e.g. inside "
                "strategy.run(); it was called in a cross-replica context."
            )
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer must already be "
                    "built: call `optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._built_on.variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        handed_over = self._take_handed_over()
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            return ops.convert_to_tensor(False)
        grads, variables = (list(side) for side in zip(*pairs))
        if loss is None:
            loss = handed_over.get("loss")
        if batch is None:
            batch = handed_over.get("batch")
        if state is None:
            state = handed_over.get("state", ())
        return self._step(
            grads, variables, loss, batch, list(state), handed_over.get("unscaled", False)
        )

    def stateless_apply(
        self,
        optimizer_variables: Sequence[tf.Tensor],
        grads: Sequence[tf.Tensor],
        trainable_variables: Sequence[tf.Tensor],
    ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        # The stock version would update the scale without bounds before
        # failing; the TF backend has no stateless path (tf.distribute).
        return super(_StockLossScaleOptimizer, self).stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

    def _step(
        self,
        grads: list[Any],
        variables: list[keras.Variable],
        loss: tf.Tensor | None,
        batch: Any,
        state: list[tuple[keras.Variable, tf.Tensor]],
        caller_unscaled: bool,
    ) -> tf.Tensor:
        """The replica's part: all-reduce, unscale, judge; then the merged write."""
        checked_batch = loss is not None or batch is not None
        if checked_batch:
            bad_batch, loss = _batch_verdict(loss, batch)
        else:
            bad_batch, loss = ops.convert_to_tensor(False), ops.zeros((), "float32")
        # Float8 scales and amax histories get their "gradient" as their new
        # value: never unscaled or clipped.
        overwritten = [is_float8_state(v) for v in variables]
        if caller_unscaled and not self._scale_is_one and any(overwritten):
            # get_unscaled_gradients() divided the new values by the scale too.
            first = next(v for v, o in zip(variables, overwritten) if o)
            raise UserInputError(
                f"variable '{first.path}' is a float8 layer's state, and the gradients "
                "passed to apply were unscaled by get_unscaled_gradients(), which divided "
                "its new value by the loss scale too. Pass the scaled gradients (of "
                "get_scaled_loss or scale_loss) to apply: it unscales all but float8 state"
            )
        # Reduce first: from here on every replica holds the same values, so
        # verdict, clipping and state updates agree on all replicas.
        grads = self._all_reduce(grads, overwritten)
        if not (caller_unscaled or self._scale_is_one):
            scale = ops.convert_to_tensor(self.dynamic_scale)
            grads = [g if o else _unscale(g, scale) for g, o in zip(grads, overwritten)]
        # One op per gradient serves the verdict and the norm: half its float32
        # sum of squares, finite iff every element is finite and its norm below
        # about 1.8e19 (where Adam's second moment would overflow); their sum
        # is finite iff all are and the global norm is below about 2.6e19.
        # A float8 value stays out of the norm, but a NaN or Inf in it is an
        # overflow too: Keras' float8 layers clip what they quantize, so an
        # Inf activation or output gradient may show nowhere else, and written
        # into an amax history it would freeze that scale for the history's
        # length.
        judged = [i for i, o in enumerate(overwritten) if not o]
        new_values = [i for i, o in enumerate(overwritten) if o]
        halves = [_half_sum_of_squares(grads[i]) for i in judged]
        half_total = tf.add_n(halves) if halves else ops.zeros(())
        new_values_finite = [ops.all(ops.isfinite(grads[i])) for i in new_values]
        finite = ops.isfinite(half_total) & ~bad_batch
        if new_values_finite:
            finite &= ops.all(ops.stack(new_values_finite))
        # Which variables overflowed is worked out only when a step is skipped.
        positions = [self._positions[id(variables[i])] for i in judged + new_values]
        should_apply, step_ends, accumulation = finite, ops.convert_to_tensor(True), []
        if self._accumulation_steps:
            grads, should_apply, step_ends, accumulation = self._accumulate(
                grads, variables, overwritten, finite
            )
        compat.maybe_merge_call(
            lambda distribution, *args: self._write_step(
                distribution,
                variables,
                positions,
                [v for v, _ in accumulation],
                [v for v, _ in state],
                checked_batch,
                *args,
            ),
            tf.distribute.get_strategy(),
            grads,
            [value for _, value in accumulation],
            [value for _, value in state],
            should_apply,
            step_ends,
            finite,
            halves,
            new_values_finite,
            bad_batch,
            loss,
            half_total,
        )
        return bad_batch

    @property
    def _scale_is_one(self) -> bool:
        """The scale is pinned at 1 (bfloat16 and float32 runs): nothing to unscale."""
        return not self.dynamic and self.initial_scale == 1.0

    def _all_reduce(self, grads: list[Any], overwritten: list[bool]) -> list[Any]:
        """Sums the gradients over the replicas; a float8 new value takes its largest.

        The largest is what one device would compute from the whole batch: the
        amax of the global batch in an amax history, and the scale (the same
        on every replica). A sum would multiply both by the replicas.
        """
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return grads
        summed = [i for i, o in enumerate(overwritten) if not o]
        largest = [i for i, o in enumerate(overwritten) if o]
        reduced = list(grads)
        values = [grads[i] for i in summed]
        if self.all_reduce_dtype is not None:
            values = [tf.cast(g, self.all_reduce_dtype) for g in values]
        for i, g in zip(summed, context.all_reduce(tf.distribute.ReduceOp.SUM, values)):
            reduced[i] = tf.cast(g, grads[i].dtype)
        if largest:
            gathered = context.all_gather([grads[i][None] for i in largest], axis=0)
            for i, g in zip(largest, gathered):
                reduced[i] = ops.max(g, axis=0)
        return reduced

    def _per_variable(self, flags: tf.Tensor, positions: list[int]) -> tf.Tensor:
        """`flags` of the given variables, spread over all the built ones (False elsewhere)."""
        count = len(self._built_on.variables)
        if positions == list(range(count)):
            return flags
        where = dict(zip(positions, range(len(positions))))
        padded = ops.concatenate([flags, ops.zeros((1,), "bool")], axis=0)
        return ops.take(padded, [where.get(i, len(positions)) for i in range(count)])

    def _accumulate(
        self,
        grads: list[Any],
        variables: list[keras.Variable],
        overwritten: list[bool],
        finite: tf.Tensor,
    ) -> tuple[list[tf.Tensor], tf.Tensor, tf.Tensor, list[tuple[keras.Variable, tf.Tensor]]]:
        """Adds a finite micro-batch to the window.

        Returns the mean of the window's finite micro-batches (for a float8
        new value their largest, as Keras' own accumulation takes: the
        window's amax), whether to apply it now (the window ends and holds a
        finite micro-batch), whether the window ends, and the accumulator and
        counter updates.
        """
        accumulators = [self._accumulators[self._positions[id(v)]] for v in variables]
        grads = [
            ops.cast(tf.convert_to_tensor(g), acc.dtype) for acc, g in zip(accumulators, grads)
        ]
        sums = [
            ops.where(finite, ops.maximum(acc, g) if o else acc + g, acc)
            for acc, g, o in zip(accumulators, grads, overwritten)
        ]
        count = self._accumulated_counter + ops.cast(finite, "int64")
        micro_batches = self._micro_batches + 1
        window_ends = micro_batches % self._accumulation_steps == 0
        means = [
            s if o else s / ops.cast(ops.maximum(count, 1), s.dtype)
            for s, o in zip(sums, overwritten)
        ]
        updates = [
            (acc, ops.where(window_ends, ops.zeros_like(s), s))
            for acc, s in zip(accumulators, sums)
        ]
        updates.append((self._accumulated_counter, ops.where(window_ends, 0, count)))
        updates.append((self._micro_batches, micro_batches))
        return means, window_ends & (count > 0), window_ends, updates

    def _write_step(
        self,
        distribution: tf.distribute.Strategy,
        variables: list[keras.Variable],
        positions: list[int],
        accumulation_variables: list[keras.Variable],
        state_variables: list[keras.Variable],
        checked_batch: bool,
        grads: list[Any],
        accumulation_values: list[Any],
        state_values: list[Any],
        *verdict: Any,
    ) -> None:
        """Writes the step in the cross-replica context.

        A cond whose branch updates mirrored variables must run here, not in a
        replica context. Every replica computed the same verdict from
        all-reduced gradients, so the first one speaks for all. Each outcome
        (applied, accumulated, skipped) writes only what it changes.
        """
        should_apply, step_ends, finite, halves, new_values_finite, bad_batch, loss, half_total = (
            _first_replica(distribution, value) for value in verdict
        )
        write = _Writer(distribution)

        def count_skip(nonfinite: tf.Tensor, overflow: tf.Tensor) -> None:
            for variable, value in zip(state_variables, state_values):
                write.assign(variable, value)  # Each replica its own value.
            write.add(self._skipped_counter, 1)
            write.add(self._nonfinite_counter, ops.cast(nonfinite, "int64"))
            if checked_batch:
                self._record_bad_batch(write, bad_batch, loss)
            if self.dynamic:
                ops.cond(overflow, lambda: self._back_off(write), lambda: None)

        def count_finite() -> None:
            if checked_batch:
                write.assign(self._last_loss, loss)
            if self.dynamic:
                self._count_finite_step(write)

        def count_nonfinite() -> None:
            # A bad batch is not an overflow: no attribution, no change of the scale.
            variables_finite = [ops.isfinite(half) for half in halves] + new_values_finite
            nonfinite = self._per_variable(~ops.stack(variables_finite), positions)
            count_skip(nonfinite & ~bad_batch, ~bad_batch)

        def judge() -> None:
            ops.cond(finite, count_finite, count_nonfinite)

        def apply() -> None:
            updated_nonfinite = self._apply_inner(distribution, grads, variables)
            if self._accumulation_steps:
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
            self._skip_inner(write, step_ends)
            if self._accumulation_steps:
                judge()  # A finite micro-batch inside the window, or a skipped one.
            else:
                count_nonfinite()

        compat.called_cond(should_apply, apply, do_not_apply)
        write.assign(self._half_squared_norm, half_total)
        for variable, value in zip(accumulation_variables, accumulation_values):
            write.assign(variable, value)

    def _apply_inner(
        self,
        distribution: tf.distribute.Strategy,
        grads: list[Any],
        variables: list[keras.Variable],
    ) -> tf.Tensor | None:
        """Runs the inner `apply()`.

        Returns:
            With float16 or bfloat16 variables, per variable whether the update
            went non-finite (and was undone); else `None`.
        """
        restored = self._built_on.update_restored
        # tf.identity reads a copy; ops.convert_to_tensor gives the variable back.
        before = [tf.identity(_tf_variable(v)) for v in restored] if restored else []
        with compat.gradients_already_reduced():
            if tf.distribute.in_cross_replica_context():
                distribution.extended.call_for_each_replica(
                    self.inner_optimizer.apply, args=(grads, variables)
                )
            else:  # No strategy: maybe_merge_call stayed in the replica context.
                self.inner_optimizer.apply(grads, variables)
        if not restored:
            return None
        checked_variables = self._built_on.update_checked
        checked = ops.stack([~ops.all(ops.isfinite(v)) for v in checked_variables])
        slots = restored[len(checked_variables) :]
        slots_nonfinite = ops.any(ops.stack([~ops.all(ops.isfinite(v)) for v in slots] or [False]))
        positions = [self._positions[id(v)] for v in checked_variables]
        # A slot that overflowed is blamed on every checked variable.
        per_variable = self._per_variable(checked | slots_nonfinite, positions)
        write = _Writer(distribution)

        def restore() -> None:
            for variable, value in zip(restored, before):
                write.assign(variable, value)

        ops.cond(ops.any(per_variable), restore, lambda: None)
        return per_variable

    def _skip_inner(self, write: _Writer, step_ends: tf.Tensor) -> None:
        """Advances the inner optimizers' `iterations` as their `apply()` would.

        With accumulation, only where the window ends: `iterations` counts
        windows.
        """
        inner = self.inner_optimizer
        counters = [inner.iterations] + [
            sub.iterations for sub in getattr(inner, "optimizers", ()) if sub.built
        ]
        for counter in counters:
            write.add(counter, ops.cast(step_ends, counter.dtype))

    def _record_bad_batch(self, write: _Writer, bad_batch: tf.Tensor, loss: tf.Tensor) -> None:
        """On a skipped step: its loss if its batch was good, its step if bad."""
        count = self._bad_batch_counter
        if self._accumulation_steps:
            step = self._micro_batches + 1  # Written after this.
        else:
            step = ops.cast(self.inner_optimizer.iterations, "int64")  # Advanced already.
        slot = ops.arange(BAD_BATCH_MEMORY, dtype="int64") == count % BAD_BATCH_MEMORY
        write.assign(self._last_loss, ops.where(bad_batch, self._last_loss, loss))
        write.assign(self._bad_batch_ring, ops.where(bad_batch & slot, step, self._bad_batch_ring))
        write.add(count, ops.cast(bad_batch, "int64"))

    def _count_finite_step(self, write: _Writer) -> None:
        """A finite step: the scale grows after `growth_interval` of them in a row."""

        def grow() -> None:
            grown = ops.minimum(self.dynamic_scale * self.growth_factor, self.max_scale)
            write.assign(self.dynamic_scale, grown)
            write.assign(self.step_counter, 0)
            write.assign(self._overflow_counter, 0)

        ops.cond(
            self.step_counter + 1 >= self.growth_interval,
            grow,
            lambda: write.add(self.step_counter, 1),
        )

    def _back_off(self, write: _Writer) -> None:
        """An overflow: the scale backs off on the `hysteresis`-th since the last growth.

        The overflow count saturates at `hysteresis`: from then on every
        overflow backs off, until a growth resets it.
        """
        overflows = ops.minimum(self._overflow_counter + 1, self.hysteresis)
        backed_off = ops.maximum(self.dynamic_scale * self.backoff_factor, self.min_scale)
        scale = ops.where(overflows >= self.hysteresis, backed_off, self.dynamic_scale)
        write.assign(self.dynamic_scale, scale)
        write.assign(self.step_counter, 0)
        write.assign(self._overflow_counter, overflows)

    def get_config(self) -> dict[str, Any]:
        # The stock keys (`dynamic_growth_steps` among them, equal to
        # `growth_interval`), so a reader of Keras' config finds them, then ours.
        config = super().get_config()
        if self._accumulation_steps:
            inner_config = config["inner_optimizer"]["config"]
            inner_config["gradient_accumulation_steps"] = self._accumulation_steps
        config.update(
            {
                field.name: getattr(self, field.name)
                for field in dataclasses.fields(LossScaleSettings)
                if field.name != "initial_scale"
            }
        )
        return config


@dataclasses.dataclass(frozen=True)
class _BuiltOn:
    """The model variables `build` was given, in its order and in the state's, and
    those an update is checked on.

    One object, not list attributes: Keras' tracker takes the variables in an
    optimizer's list attribute for the optimizer's own, so the model's
    variables would join `optimizer.variables`, be saved with its state and be
    loaded by position (a loaded float8 model lists its variables in another
    order than the model saved).
    """

    variables: tuple[keras.Variable, ...]
    in_state_order: tuple[keras.Variable, ...]  # The order of the per-variable state.
    update_checked: tuple[keras.Variable, ...]
    update_restored: tuple[keras.Variable, ...]


class _Writer:
    """Writes optimizer variables in the cross-replica context (or with no strategy)."""

    def __init__(self, distribution: tf.distribute.Strategy) -> None:
        self._update = distribution.extended.update

    def assign(self, variable: keras.Variable, value: Any) -> None:
        self._update(_tf_variable(variable), _assign, args=(value,), group=False)

    def add(self, variable: keras.Variable, value: Any) -> None:
        self._update(_tf_variable(variable), _assign_add, args=(value,), group=False)


def _read(variable: keras.Variable, to_python: type) -> Any:
    if tf.executing_eagerly():
        # Not np.array(variable) (ops.convert_to_numpy): Keras' Variable.__array__
        # takes no `copy`, which NumPy 2 deprecates with a warning, and Keras'
        # saving reads these properties on every save and load.
        return to_python(variable.numpy())
    return ops.convert_to_tensor(variable)


def _unscale(gradient: tf.Tensor, scale: tf.Tensor | keras.Variable) -> tf.Tensor:
    # ops.divide promotes float16 to float32 (the scale's dtype), so small
    # unscaled gradients do not flush to zero.
    return ops.divide(gradient, scale)


def _unscaled_like(
    gradient: tf.Tensor | tf.IndexedSlices, scale: tf.Tensor | keras.Variable
) -> tf.Tensor | tf.IndexedSlices:
    """`gradient / scale` (computed in float32) in the gradient's dtype and form."""
    if isinstance(gradient, tf.IndexedSlices):
        values = _unscaled_like(gradient.values, scale)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return ops.cast(_unscale(gradient, scale), gradient.dtype)


def _half_sum_of_squares(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """`sum(g**2) / 2` in float32, one kernel (`l2_loss`) for a float32 gradient."""
    values = _values(gradient)
    # In float32: the square of a float16 gradient above 256 would overflow.
    if values.dtype != tf.float32:
        values = tf.cast(values, tf.float32)
    return tf.nn.l2_loss(values)


def _values(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    # Check an embedding's sparse gradient without densifying it.
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _batch_verdict(loss: tf.Tensor | None, batch: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """Whether any replica's batch (or, without one, loss) is bad data; the global loss.

    With the batch at hand, a NaN or Inf in it is bad data, and a non-finite
    loss from a finite batch a forward-pass overflow. Without it, a NaN loss
    is bad data and an infinite one an overflow. A loss of any shape (a custom
    loop's per-example losses) is judged element by element and recorded as
    its sum: the loss whose gradient the tape computes.
    """
    if loss is None:
        loss = ops.zeros((), "float32")
    loss = ops.cast(loss, "float32")
    loss_is_nan = ops.any(ops.isnan(loss))
    loss = ops.sum(loss)
    if batch is None:
        flags = [loss_is_nan]
    else:
        values = [_dense_values(t) for t in keras.tree.flatten(batch)]
        flags = [
            ~ops.all(ops.isfinite(v)) for v in values if v is not None and v.dtype.is_floating
        ] or [ops.convert_to_tensor(False)]
    bad = ops.any(ops.stack(flags))
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        # Every replica must agree, as on the gradients: one all-reduce of
        # the bad-batch votes and the (distribution-scaled) losses.
        votes, loss = ops.unstack(
            context.all_reduce(
                tf.distribute.ReduceOp.SUM, ops.stack([ops.cast(bad, "float32"), loss])
            )
        )
        bad = votes > 0
    return bad, loss


def state_before(variables: Sequence[keras.Variable]) -> list[tuple[keras.Variable, tf.Tensor]]:
    """The floating `variables` with a copy of their values now, for `apply(state=...)`."""
    return [
        (v, tf.identity(_tf_variable(v))) for v in variables if tf.as_dtype(v.dtype).is_floating
    ]


def _first_replica(distribution: tf.distribute.Strategy, value: Any) -> Any:
    """The first replica's value (of each in a list): every replica holds the same."""
    if isinstance(value, list):
        return [_first_replica(distribution, v) for v in value]
    return distribution.experimental_local_results(value)[0]


def _dense_values(value: Any) -> tf.Tensor | None:
    """The values of a batch's tensor (dense, ragged or sparse); None for anything else."""
    if isinstance(value, tf.RaggedTensor):
        return value.flat_values
    if isinstance(value, tf.SparseTensor):
        return value.values
    return value if isinstance(value, tf.Tensor) else None


def _current_graph() -> Any:
    return tf.compat.v1.get_default_graph()


def _replica_trace_key() -> tuple[int, int]:
    """This replica in this trace: its graph and its replica context."""
    return id(_current_graph()), id(tf.distribute.get_replica_context())


def _tf_variable(variable: keras.Variable | tf.Variable) -> tf.Variable:
    return variable.value if isinstance(variable, keras.Variable) else variable


def _assign(variable: tf.Variable, value: tf.Tensor) -> None:
    variable.assign(value)


def _assign_add(variable: tf.Variable, value: tf.Tensor) -> None:
    variable.assign_add(ops.cast(value, variable.dtype))
