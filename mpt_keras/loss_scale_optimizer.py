"""Dynamic loss scaling that stays correct under tf.distribute, clipping and XLA.

`LossScaleOptimizer` is a drop-in subclass of
`keras.optimizers.LossScaleOptimizer` for the TensorFlow backend. See the class
docstring for what it changes and why.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from mpt_keras.errors import UserInputError

_StockLossScaleOptimizer = keras.optimizers.LossScaleOptimizer

# The scale lives in a float32 variable: a bound outside this range would
# round to 0 or inf, which is exactly what the bounds exist to prevent.
_SCALE_LOW = float(np.finfo(np.float32).tiny)
_SCALE_HIGH = float(np.finfo(np.float32).max)
_ALL_REDUCE_DTYPES = (None, "float32", "bfloat16", "float16")
# How many of the latest bad batches' steps `bad_batch_steps` remembers.
BAD_BATCH_MEMORY = 64


@keras.saving.register_keras_serializable(package="mpt_keras")
class LossScaleOptimizer(_StockLossScaleOptimizer):
    """Dynamic loss scaling with one verdict for all replicas.

    Wraps `inner_optimizer` like `keras.optimizers.LossScaleOptimizer` (and is
    one, so `model.compile` does not wrap it again), but each step:

    1. all-reduces the gradients across replicas first (the sum the inner
       optimizer would compute anyway), then unscales them;
    2. decides finiteness on those all-reduced, unscaled gradients, so a
       non-finite gradient on any replica skips the step on every replica and
       backs the scale off everywhere. A variable's gradient counts as
       non-finite when its float32 sum of squares is: a NaN or Inf element,
       or a norm above 1.8e19 (whose square would turn Adam's second moment
       into inf). The same sums give `gradient_norm`;
    3. clips (`clipnorm`, `global_clipnorm`, `clipvalue` of the inner
       optimizer) the unscaled, all-reduced gradient, so two replicas give the
       single-device update;
    4. applies the inner optimizer's update (weight decay, `update_step`, EMA)
       only if the step is finite; a skipped step leaves weights and slots
       untouched but still advances `iterations` (ours and the inner
       optimizer's, so learning-rate schedules follow the step count).

    The scale grows by `growth_factor` after `growth_interval` consecutive
    finite steps and backs off by `backoff_factor` on an overflow, clamped to
    `[min_scale, max_scale]`. With `hysteresis=h` the scale backs off on the
    h-th overflow since the last growth and on every later one until the next
    growth (DeepSpeed's delayed shift, Megatron's hysteresis); every overflow
    step is skipped. `dynamic=False` pins the scale at `initial_scale` (e.g. 1
    for bfloat16 or float32 runs) while still skipping and counting
    non-finite steps.

    With `gradient_accumulation_steps=k` on the inner optimizer, unscaled
    float32 gradients are accumulated. A non-finite micro-batch is dropped
    (counted in `skipped_steps`) and the window goes on; at the end of the
    window the mean of its finite micro-batches is clipped and applied, as a
    large batch made of those micro-batches would be. A window without any
    finite micro-batch applies nothing. Gradients are all-reduced every
    micro-batch, so that each micro-batch gets one verdict for all replicas.

    `all_reduce_dtype="bfloat16"` or `"float16"` sums the (scaled) gradients
    across replicas in that dtype, halving the bytes on the wire of multi-host
    runs, and casts the sum back before unscaling. The trade-offs: a float16
    sum of scaled gradients overflows above 65504, which skips the step and
    backs the scale off (safe, but more skipped steps); a bfloat16 sum keeps
    float32's range but only 8 bits of mantissa (relative error up to 2**-8
    per rounding). With one replica nothing is cast. MirroredStrategy's
    default NCCL all-reduce on GPUs has no bfloat16 kernel.

    Bad data is not an overflow: `check_batch(x, y, sample_weight)` before
    `apply` (the train step of `mpt_keras.xla.compile_model` calls it) makes
    a batch with a NaN or Inf in any floating input, label or weight, on any
    replica, skip the step without touching the scale or the per-variable
    overflow counts. It is counted in `skipped_steps` and `bad_batches`, and
    its step (1-based, the value of `iterations` after it) recorded in
    `bad_batch_steps()`. This works in every precision, float32 included.

    All state (scale, growth and overflow counters, skipped steps, bad batches,
    per-variable non-finite counts) is optimizer variables updated in-graph (no host sync
    per step; int64 counters), so it is saved by `model.save` and
    `tf.train.Checkpoint`.

    Custom loops written for Keras 2 (`get_scaled_loss`,
    `get_unscaled_gradients`, `apply_gradients`) work unchanged, as do Keras 3
    loops that pass the gradients of `scale_loss(loss)` to `apply`.

    Limitations: TensorFlow backend only (`stateless_apply` raises). Under a
    tf.distribute strategy, build the optimizer before a custom `tf.function`
    loop (`fit` does); building it lazily inside `strategy.run` fails in TF, as
    with the stock class. Variables with `overwrite_with_gradient` (float8) are
    written by the base optimizer before the finiteness check, as plain
    optimizers do. Adam-style bias correction counts skipped steps, since
    `iterations` does.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        initial_scale: Starting loss scale, in `[min_scale, max_scale]`.
        growth_factor: Factor (> 1) applied after `growth_interval` finite
            steps.
        backoff_factor: Factor in (0, 1) applied on an overflow.
        growth_interval: Consecutive finite steps (int >= 1) between growths;
            2000 unless given (or given as `dynamic_growth_steps`).
        hysteresis: Overflows since the last growth (int >= 1) before the scale
            backs off.
        min_scale: Lower bound of the scale (> 0).
        max_scale: Upper bound of the scale (finite float32).
        dynamic: If False, the scale stays at `initial_scale`.
        all_reduce_dtype: The dtype of the cross-replica gradient sum:
            `None` (the gradients' own, float32 for float32 variables),
            `"float32"`, `"bfloat16"` or `"float16"`.
        name: Optimizer name.
        dynamic_growth_steps: Keras' name of `growth_interval` (the stock
            class's argument and config key); giving both with different
            values is an error.
        **kwargs: Accepted for deserialization compatibility with the stock
            class only; base optimizer arguments belong on `inner_optimizer`.

    Example:

    >>> import keras, numpy as np
    >>> from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
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
        growth_interval = _growth_interval(growth_interval, dynamic_growth_steps)
        _validate_arguments(
            inner_optimizer=inner_optimizer,
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic,
            all_reduce_dtype=all_reduce_dtype,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=int(growth_interval),
            name=name,
            **kwargs,
        )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = dynamic
        self.all_reduce_dtype = all_reduce_dtype
        # get_unscaled_gradients() marks the next apply() as receiving
        # unscaled gradients. Per thread: MirroredStrategy runs each replica
        # in its own thread.
        self._caller_unscaled = threading.local()
        # check_batch() marks the next apply() of the same replica (thread).
        self._pending_batch = threading.local()
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
        # For MixedPrecisionMonitor: the global norm of the last step's
        # unscaled, all-reduced gradients, before clipping (inf or NaN on a
        # skipped step). Written in-graph, read only when someone asks.
        self.gradient_norm = self.add_variable(
            shape=(), initializer="zeros", dtype="float32", name="gradient_norm"
        )

    def _add_counter(self, name: str, shape: tuple[int, ...] = ()) -> keras.Variable:
        return self.add_variable(shape=shape, dtype="int64", name=name)

    def build(self, var_list: Sequence[keras.Variable]) -> None:
        # Not the stock build: __init__ already made the scale variables.
        self.inner_optimizer.build(var_list)
        self._nonfinite_counter = self._add_counter("nonfinite_counter", (len(var_list),))
        if self.inner_optimizer.gradient_accumulation_steps:
            self._accumulated_counter = self._add_counter("accumulated_counter")
        super(_StockLossScaleOptimizer, self).build(var_list)

    @property
    def loss_scale(self) -> float | tf.Tensor:
        """The current loss scale: a float eagerly, a tensor in a graph."""
        return _read(self.dynamic_scale, float)

    @property
    def skipped_steps(self) -> int | tf.Tensor:
        """Steps (micro-batches) skipped because a gradient was non-finite."""
        return _read(self._skipped_counter, int)

    @property
    def bad_batches(self) -> int | tf.Tensor:
        """Steps skipped because their batch held a NaN or Inf (see `check_batch`)."""
        return _read(self._bad_batch_counter, int)

    def bad_batch_steps(self) -> list[int]:
        """The steps of the latest `BAD_BATCH_MEMORY` bad batches, in order.

        Call eagerly: reading them syncs with the device.
        """
        count = int(self._bad_batch_counter.numpy())
        ring = self._bad_batch_ring.numpy()
        first = max(0, count - BAD_BATCH_MEMORY)
        return [int(ring[i % BAD_BATCH_MEMORY]) for i in range(first, count)]

    @property
    def last_loss(self) -> float | tf.Tensor:
        """The loss of the last step whose batch was finite, as given to `check_batch`."""
        return _read(self._last_loss, float)

    def check_batch(self, batch: Any, loss: tf.Tensor | None = None) -> tf.Tensor:
        """Makes the next `apply` in this replica skip the step if `batch` is not finite.

        Args:
            batch: A tensor or a nested structure of them (inputs, labels,
                sample weights); integer and `None` entries are ignored.
            loss: This replica's loss of the batch, scaled for distribution as
                Keras' `compute_loss` returns it; the next `apply` records the
                global loss in `last_loss` (unless the batch is bad).

        Returns:
            Whether the batch of any replica holds a NaN or Inf (a bool
            tensor, the same on every replica).

        Call it in a replica context (inside `strategy.run`, as the train
        step is), in every replica: it all-reduces the verdict.
        """
        flags = [
            ~ops.all(ops.isfinite(t))
            for t in keras.tree.flatten(batch)
            if t is not None and tf.as_dtype(t.dtype).is_floating
        ]
        bad = ops.any(ops.stack(flags)) if flags else ops.convert_to_tensor(False)
        loss = ops.zeros((), "float32") if loss is None else ops.cast(loss, "float32")
        replica_context = tf.distribute.get_replica_context()
        if replica_context.num_replicas_in_sync > 1:
            # Every replica must agree, as on the gradients: one all-reduce of
            # the bad-batch votes and the (distribution-scaled) losses.
            votes, loss = ops.unstack(
                replica_context.all_reduce(
                    tf.distribute.ReduceOp.SUM, ops.stack([ops.cast(bad, "float32"), loss])
                )
            )
            bad = votes > 0
        self._pending_batch.bad = bad
        self._pending_batch.loss = loss
        return self._pending_batch.bad

    def nonfinite_counts(self) -> dict[str, int]:
        """Counts, per variable path, the steps whose gradient was non-finite.

        Call eagerly: reading the counts syncs with the device.
        """
        if not self.built:
            return {}
        counts = self._nonfinite_counter.numpy()
        return {
            getattr(v, "path", v.name): int(c) for v, c in zip(self._trainable_variables, counts)
        }

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        return ops.multiply(loss, self.dynamic_scale)

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
        `None`. The next `apply`/`apply_gradients` in the same thread
        (replica) then takes its gradients as already unscaled, as in the TF
        mixed-precision guide; they may be transformed (e.g. clipped) in
        between.
        """
        self._caller_unscaled.pending = True
        return [None if g is None else _unscaled_like(g, self.dynamic_scale) for g in grads]

    def apply(
        self,
        grads: Sequence[tf.Tensor | None],
        trainable_variables: Sequence[keras.Variable] | None = None,
    ) -> None:
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "apply() must be called in a replica context, e.g. inside "
                "strategy.run(); it was called in a cross-replica context."
            )
        # The stock apply decides finiteness per replica. BaseOptimizer.apply
        # builds, filters missing gradients and calls _backend_apply_gradients.
        super(_StockLossScaleOptimizer, self).apply(grads, trainable_variables)

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

    def _backend_apply_gradients(
        self, grads: list[tf.Tensor], trainable_variables: list[keras.Variable]
    ) -> None:
        inner = self.inner_optimizer
        caller_unscaled = getattr(self._caller_unscaled, "pending", False)
        self._caller_unscaled.pending = False
        checked = getattr(self._pending_batch, "bad", None) is not None
        bad_batch = self._pending_batch.bad if checked else ops.convert_to_tensor(False)
        loss = self._pending_batch.loss if checked else None
        self._pending_batch.bad = self._pending_batch.loss = None
        # Reduce first: from here on every replica holds the same values, so
        # verdict, clipping and state updates agree on all replicas.
        reduced = self._all_reduce_sum_gradients(zip(grads, trainable_variables))
        grads = [g for g, _ in reduced]
        if not caller_unscaled:
            scale = ops.convert_to_tensor(self.dynamic_scale)
            grads = [_unscale(g, scale) for g in grads]
        # One pass over each gradient serves the verdict and the norm: its
        # float32 sum of squares is finite iff every element is finite and the
        # gradient's norm is below 1.8e19 (where Adam's second moment would
        # overflow). Vectorised over variables: a few ops per step, not per
        # variable.
        squares = ops.stack([_sum_of_squares(g) for g in grads])
        nonfinite = ~ops.isfinite(squares)
        finite = ~ops.any(nonfinite) & ~bad_batch
        # A bad batch is not an overflow: no attribution, no change of the scale.
        nonfinite = nonfinite & ~bad_batch
        assignments = self._counter_updates(finite, nonfinite, trainable_variables)
        if checked:
            assignments += self._bad_batch_updates(bad_batch, loss)
        assignments.append((self.gradient_norm, ops.sqrt(ops.sum(squares))))
        if self.dynamic:
            assignments += [
                (variable, ops.where(bad_batch, variable, value))
                for variable, value in self._scale_updates(finite)
            ]
        should_update = finite
        if inner.gradient_accumulation_steps:
            grads, should_update, accumulator_updates = self._accumulate(
                grads, finite, trainable_variables
            )
            assignments += accumulator_updates
        grads = inner._clip_gradients(grads)
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._distributed_apply,
            tf.distribute.get_strategy(),
            list(zip(grads, map(_tf_variable, trainable_variables))),
            should_update,
            inner.learning_rate,
            [(_tf_variable(v), value) for v, value in assignments],
        )

    def _all_reduce_sum_gradients(
        self, grads_and_vars: Sequence[tuple[tf.Tensor | None, keras.Variable]]
    ) -> list[tuple[tf.Tensor | None, keras.Variable]]:
        grads_and_vars = list(grads_and_vars)
        if self.all_reduce_dtype is None or tf.distribute.get_strategy().num_replicas_in_sync == 1:
            return super()._all_reduce_sum_gradients(grads_and_vars)
        dtypes = [None if g is None else g.dtype for g, _ in grads_and_vars]
        reduced = super()._all_reduce_sum_gradients(
            [
                (None if g is None else tf.cast(g, self.all_reduce_dtype), v)
                for g, v in grads_and_vars
            ]
        )
        return [(None if g is None else tf.cast(g, d), v) for (g, v), d in zip(reduced, dtypes)]

    def _counter_updates(
        self,
        finite: tf.Tensor,
        nonfinite: tf.Tensor,
        trainable_variables: list[keras.Variable],
    ) -> list[tuple[keras.Variable, tf.Tensor]]:
        """Counts the step: iterations, skipped steps, overflows per variable.

        `nonfinite` holds one flag per entry of `trainable_variables`; the
        optimizer's variables without a gradient this step count no overflow.
        """
        indices = [self._get_variable_index(v) for v in trainable_variables]
        if indices != list(range(len(self._trainable_variables))):
            # Index `len(indices)` is an appended False, for the variables
            # without a gradient.
            positions = dict(zip(indices, range(len(indices))))
            nonfinite = tf.gather(
                tf.concat([nonfinite, [False]], axis=0),
                [positions.get(i, len(indices)) for i in range(len(self._trainable_variables))],
            )
        iterations = self.inner_optimizer._iterations
        return [
            (self._skipped_counter, self._skipped_counter + ops.cast(~finite, "int64")),
            (self._nonfinite_counter, self._nonfinite_counter + ops.cast(nonfinite, "int64")),
            (iterations, iterations + 1),
        ]

    def _bad_batch_updates(
        self, bad_batch: tf.Tensor, loss: tf.Tensor
    ) -> list[tuple[keras.Variable, tf.Tensor]]:
        """Records a checked batch: its loss if good, its step if bad."""
        count = self._bad_batch_counter
        step = ops.cast(self.inner_optimizer._iterations, "int64") + 1
        slot = ops.arange(BAD_BATCH_MEMORY, dtype="int64") == count % BAD_BATCH_MEMORY
        return [
            (self._last_loss, ops.where(bad_batch, self._last_loss, loss)),
            (count, count + ops.cast(bad_batch, "int64")),
            (self._bad_batch_ring, ops.where(bad_batch & slot, step, self._bad_batch_ring)),
        ]

    def _scale_updates(self, finite: tf.Tensor) -> list[tuple[keras.Variable, tf.Tensor]]:
        scale = ops.convert_to_tensor(self.dynamic_scale)
        finite_steps = self.step_counter + 1
        grow = finite & (finite_steps >= self.growth_interval)
        # Saturates at hysteresis: from then on every overflow backs off,
        # until a growth resets it.
        overflows = ops.minimum(self._overflow_counter + 1, self.hysteresis)
        back_off = ~finite & (overflows >= self.hysteresis)
        grown = ops.minimum(scale * self.growth_factor, self.max_scale)
        backed_off = ops.maximum(scale * self.backoff_factor, self.min_scale)
        kept_overflows = ops.where(finite, self._overflow_counter, overflows)
        return [
            (
                self.dynamic_scale,
                ops.where(grow, grown, ops.where(back_off, backed_off, scale)),
            ),
            (self.step_counter, ops.where(finite & ~grow, finite_steps, 0)),
            (self._overflow_counter, ops.where(grow, 0, kept_overflows)),
        ]

    def _accumulate(
        self,
        grads: list[tf.Tensor],
        finite: tf.Tensor,
        trainable_variables: list[keras.Variable],
    ) -> tuple[list[tf.Tensor], tf.Tensor, list[tuple[keras.Variable, tf.Tensor]]]:
        """Adds a finite micro-batch to the window.

        Returns the mean of the window's finite micro-batches, whether to apply
        it now (the window ends and holds a finite micro-batch) and the
        accumulator updates (reset when the window ends).
        """
        inner = self.inner_optimizer
        accumulators = [
            inner._accumulated_gradients[inner._get_variable_index(v)] for v in trainable_variables
        ]
        sums = [
            ops.where(finite, acc + ops.cast(tf.convert_to_tensor(g), acc.dtype), acc)
            for acc, g in zip(accumulators, grads)
        ]
        count = self._accumulated_counter + ops.cast(finite, "int64")
        steps = inner.gradient_accumulation_steps
        window_ends = (inner._iterations + 1) % steps == 0
        means = [s / ops.cast(ops.maximum(count, 1), s.dtype) for s in sums]
        updates = [
            (acc, ops.where(window_ends, ops.zeros_like(s), s))
            for acc, s in zip(accumulators, sums)
        ]
        updates.append((self._accumulated_counter, ops.where(window_ends, 0, count)))
        return means, window_ends & (count > 0), updates

    def _distributed_apply(
        self,
        distribution: tf.distribute.Strategy,
        grads_and_vars: list[tuple[tf.Tensor, tf.Variable]],
        should_update: tf.Tensor,
        learning_rate: tf.Tensor,
        assignments: list[tuple[tf.Variable, tf.Tensor]],
    ) -> None:
        """Writes the step in the merged (cross-replica) context.

        A cond whose branch updates mirrored variables must run here, not in a
        replica context. Every replica computed the same `should_update` from
        all-reduced gradients, so the first one speaks for all.
        """

        def update() -> None:
            for grad, var in grads_and_vars:
                distribution.extended.update(
                    var, self._update_variable, args=(grad, learning_rate), group=False
                )
            self._update_moving_average()

        ops.cond(
            distribution.experimental_local_results(should_update)[0],
            update,
            lambda: None,
        )
        # After the cond, so that the update reads the old iterations (Adam's
        # bias correction, EMA).
        for var, value in assignments:
            distribution.extended.update(var, _assign, args=(value,), group=False)

    def _update_variable(
        self, variable: tf.Variable, gradient: tf.Tensor, learning_rate: tf.Tensor
    ) -> None:
        inner = self.inner_optimizer
        # The inner optimizer's weight decay goes through a merge_call, which
        # cannot run inside this cond; this is the same decay per variable.
        if inner.weight_decay is not None and inner._use_weight_decay(variable):
            decay = ops.cast(inner.weight_decay, variable.dtype) * ops.cast(
                learning_rate, variable.dtype
            )
            variable.assign_sub(variable * decay)
        inner.update_step(gradient, variable, learning_rate)

    def _update_moving_average(self) -> None:
        inner = self.inner_optimizer
        if not inner.use_ema:
            return
        inner._update_model_variables_moving_average(inner._trainable_variables)
        if inner.ema_overwrite_frequency:
            ops.cond(
                ops.equal((inner.iterations + 1) % inner.ema_overwrite_frequency, 0),
                lambda: inner._overwrite_model_variables_with_average_value(
                    inner._trainable_variables
                ),
                lambda: None,
            )

    def get_config(self) -> dict[str, Any]:
        # The stock keys (`dynamic_growth_steps` among them, equal to
        # `growth_interval`), so a reader of Keras' config finds them, then ours.
        config = super().get_config()
        config.update(
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            dynamic=self.dynamic,
            all_reduce_dtype=self.all_reduce_dtype,
        )
        return config


def _validate_arguments(
    *,
    inner_optimizer: Any,
    initial_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
    dynamic: bool,
    all_reduce_dtype: str | None,
) -> None:
    # In order: later checks compare values that earlier checks proved numbers.
    a_scale = f"a positive finite float32 number (in [{_SCALE_LOW:.4g}, {_SCALE_HIGH:.4g}])"
    checks = [
        (
            "inner_optimizer",
            inner_optimizer,
            lambda v: (
                isinstance(v, keras.optimizers.Optimizer)
                and not isinstance(v, _StockLossScaleOptimizer)
            ),
            "a keras.optimizers.Optimizer that is not a LossScaleOptimizer",
        ),
        ("initial_scale", initial_scale, _is_scale, a_scale),
        ("min_scale", min_scale, _is_scale, a_scale),
        ("max_scale", max_scale, _is_scale, a_scale),
        ("max_scale", max_scale, lambda v: v >= min_scale, f">= min_scale={min_scale}"),
        (
            "initial_scale",
            initial_scale,
            lambda v: min_scale <= v <= max_scale,
            f"in [min_scale, max_scale] = [{min_scale}, {max_scale}]",
        ),
        (
            "growth_factor",
            growth_factor,
            lambda v: _is_number(v) and 1 < v <= _SCALE_HIGH,
            "a finite number > 1",
        ),
        (
            "backoff_factor",
            backoff_factor,
            lambda v: _is_number(v) and 0 < v < 1,
            "in the open interval (0, 1)",
        ),
        ("growth_interval", growth_interval, _is_count, "an integer >= 1"),
        ("hysteresis", hysteresis, _is_count, "an integer >= 1"),
        ("dynamic", dynamic, lambda v: isinstance(v, bool), "True or False"),
        (
            "all_reduce_dtype",
            all_reduce_dtype,
            lambda v: v in _ALL_REDUCE_DTYPES,
            "None, 'float32', 'bfloat16' or 'float16'",
        ),
    ]
    for name, value, is_valid, allowed in checks:
        if not is_valid(value):
            raise UserInputError(f"Argument {name} must be {allowed}. Received: {name}={value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_scale(value: Any) -> bool:
    return _is_number(value) and _SCALE_LOW <= value <= _SCALE_HIGH


def _is_count(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


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


def _growth_interval(growth_interval: int | None, dynamic_growth_steps: int | None) -> Any:
    """One growth interval from our argument and Keras' name for it."""
    if growth_interval is None:
        return 2000 if dynamic_growth_steps is None else dynamic_growth_steps
    if dynamic_growth_steps is not None and dynamic_growth_steps != growth_interval:
        raise UserInputError(
            "growth_interval and dynamic_growth_steps are one setting (Keras' name for it) and "
            f"differ. Received: growth_interval={growth_interval!r}, "
            f"dynamic_growth_steps={dynamic_growth_steps!r}; give one of them"
        )
    return growth_interval


def _sum_of_squares(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    # In float32: the square of a float16 gradient above 256 would overflow.
    return ops.sum(ops.square(ops.cast(_values(gradient), "float32")))


def _values(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    # Check an embedding's sparse gradient without densifying it.
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _tf_variable(variable: keras.Variable | tf.Variable) -> tf.Variable:
    return variable.value if isinstance(variable, keras.Variable) else variable


def _assign(variable: tf.Variable, value: tf.Tensor) -> None:
    variable.assign(value)
