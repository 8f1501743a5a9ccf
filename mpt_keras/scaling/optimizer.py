"""Dynamic loss scaling that stays correct under distribution, clipping and XLA, on
Keras' TensorFlow backend (`step`: variables written in one cross-replica `cond`) and its JAX
backend (`stateless_step`: the same rules as a function of values)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from mpt_keras import compat
from mpt_keras.backend import current
from mpt_keras.checks import refusal
from mpt_keras.scaling import readings, scale_rule, stateless_step
from mpt_keras.scaling import settings as loss_scale_settings
from mpt_keras.scaling.accumulation import Accumulation
from mpt_keras.scaling.hand_over import HandOvers, LossScaleSteps, StepVerdict, state_before
from mpt_keras.scaling.health import BAD_BATCH_MEMORY, StepHealth
from mpt_keras.scaling.own_variables import (
    ModelVariables,
    OwnVariables,
    caller_unscaled,
)
from mpt_keras.scaling.scale_rule import ScaleVariables
from mpt_keras.scaling.settings import LossScaleSettings

_StockLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
_DEFAULTS = LossScaleSettings()


@keras.saving.register_keras_serializable(package="mpt_keras")
class LossScaleOptimizer(_StockLossScaleOptimizer):
    """Dynamic loss scaling with one verdict for all replicas.

    A `keras.optimizers.LossScaleOptimizer` (so `model.compile` does not wrap it again) that
    judges the all-reduced, unscaled gradients: an overflow (or an update overflowing float16
    variables, undone) is skipped on every replica and backs the scale off; a NaN or Inf batch
    is skipped as bad data, the scale left alone; a finite step runs the inner `apply()` on
    the sum, so clipping, weight decay and EMA work as unscaled. The scale grows by
    `growth_factor` after `growth_interval` finite steps and backs off by `backoff_factor`
    from the `hysteresis`-th overflow since the last growth, within `[min_scale, max_scale]`.
    It takes over the inner `gradient_accumulation_steps` and `loss_scale_factor`; all state
    is optimizer variables. On JAX, Keras' trainer calls `stateless_apply`, which takes the
    same steps as values. docs/loss_scaling.md compares it with Keras', tf-keras' and PyTorch's.

    Args:
        initial_scale, ..., all_reduce_dtype: `LossScaleSettings` (checked, defaulted there).
        dynamic_growth_steps: Keras' name of `growth_interval`; both, differing, is an error.
        **kwargs: The stock class's, for deserialization only.

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
        initial_scale: float = _DEFAULTS.initial_scale,
        growth_factor: float = _DEFAULTS.growth_factor,
        backoff_factor: float = _DEFAULTS.backoff_factor,
        growth_interval: int | None = None,
        hysteresis: int = _DEFAULTS.hysteresis,
        min_scale: float = _DEFAULTS.min_scale,
        max_scale: float = _DEFAULTS.max_scale,
        dynamic: bool = _DEFAULTS.dynamic,
        all_reduce_dtype: str | None = _DEFAULTS.all_reduce_dtype,
        name: str | None = None,
        dynamic_growth_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer) or isinstance(
            inner_optimizer, _StockLossScaleOptimizer
        ):
            raise refusal(
                "Argument inner_optimizer",
                repr(inner_optimizer),
                "a keras.optimizers.Optimizer that is not a LossScaleOptimizer",
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
        # The stock init sets the inner loss_scale_factor to None: the loss scale replaces it.
        super().__init__(
            inner_optimizer,
            initial_scale=float(settings.initial_scale),
            dynamic_growth_steps=int(settings.growth_interval),
            name=name,
            **kwargs,
        )
        # Accumulation is ours (see `accumulation`); `get_config` puts the setting back.
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
        self._handed_over = HandOvers()
        self._loss_scale_steps = LossScaleSteps()
        # Made here, not in build(): a scale_loss() traced before apply() must read it.
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
        self._half_squared_norm = self.add_variable(
            shape=(), initializer="zeros", dtype="float32", name="half_squared_gradient_norm"
        )

    def _add_counter(self, name: str, shape: tuple[int, ...] = ()) -> keras.Variable:
        # "int": int64 on TensorFlow; on JAX, int32 unless x64 is on (Keras' `iterations` too).
        return self.add_variable(shape=shape, dtype="int", name=name)

    def build(self, var_list: Sequence[keras.Variable]) -> None:
        var_list = list(var_list)
        inner = self.inner_optimizer
        inner.build(var_list)
        # In path order: state loads by position, and a loaded float8 model lists its variables
        # in another order.
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
        self._built_on = ModelVariables.of(var_list, in_state_order, inner)

    def load_own_variables(self, store: Any) -> None:
        """Loads our saved state, or the stock class's (scale clamped, the rest of ours fresh)."""
        inner_variables = self.inner_optimizer.variables
        # The stock class saves four variables (iterations, learning rate, growth counter,
        # scale) and then the inner optimizer's.
        if len(store.keys()) == len(self.variables) or len(store.keys()) != 4 + len(
            inner_variables
        ):
            super().load_own_variables(store)
            return
        self.step_counter.assign(store["2"])
        scale = scale_rule.clamped(float(store["3"][...]), self.min_scale, self.max_scale)
        self.dynamic_scale.assign(scale)
        for i, variable in enumerate(inner_variables):
            variable.assign(store[str(4 + i)])

    @property
    def loss_scale(self) -> Any:
        """The current loss scale: a float eagerly, a tensor in a graph."""
        return readings.read(self.dynamic_scale, float)

    @property
    def skipped_steps(self) -> Any:
        """Steps (micro-batches) skipped: non-finite gradients, updates or batches."""
        return readings.read(self._skipped_counter, int)

    @property
    def bad_batches(self) -> Any:
        """Steps skipped because their loss or batch held a NaN or Inf."""
        return readings.read(self._bad_batch_counter, int)

    @property
    def gradient_norm(self) -> Any:
        """The last step's unscaled global gradient norm, before clipping (a tensor)."""
        return readings.gradient_norm(self._own_variables())

    @property
    def last_loss(self) -> Any:
        """The loss (summed over replicas and elements) of the last step with a finite batch."""
        return readings.read(self._last_loss, float)

    def step_logs(
        self, values: Sequence[Any] | None = None, trainable_values: Sequence[Any] = ()
    ) -> dict[str, Any]:
        """The loss-scaling state for a train step's logs, read in its graph after `apply()`
        so each step's logs hold its own values even where callbacks lag; on JAX, of the
        optimizer `values` and `trainable_values` its `stateless_apply` returned."""
        if values is None:
            return readings.step_logs(self._own_variables())
        mapping = list(zip(self.variables, values))
        if self.built:
            mapping += list(zip(self._built_on.variables, trainable_values))
        with keras.StatelessScope(state_mapping=mapping):
            return readings.step_logs(self._own_variables())

    def health(self) -> StepHealth:
        """The `StepHealth` the last steps left, in one read (call eagerly)."""
        return readings.health(self._own_variables())

    def bad_batch_steps(self) -> list[int]:
        """The steps of the latest `BAD_BATCH_MEMORY` bad batches, in order."""
        return list(self.health().bad_batch_steps)

    def nonfinite_counts(self) -> dict[str, int]:
        """Per variable path, the steps whose gradient or update was non-finite (call eagerly)."""
        return readings.nonfinite_counts(self._own_variables())

    def scale_loss(self, loss: Any) -> Any:
        """The loss times the scale; this replica's next `apply` judges the loss (see `apply`)."""
        loss = ops.convert_to_tensor(loss)  # A number or a tensor of any shape, as the stock.
        self._loss_scale_steps.check_readable(self.dynamic_scale, "scale_loss")
        self._loss_scale_steps.mark_scaled()
        if not (current.is_jax() and current.is_traced(loss)):  # It would leak from jax.grad.
            self._handed_over.put(loss=loss)
        return ops.multiply(loss, ops.cast(self.dynamic_scale, loss.dtype))

    def get_scaled_loss(self, loss: Any | Callable[[], Any]) -> Any | Callable[[], Any]:
        """Keras 2 (tf-keras) API: the loss times the scale (for a callable, a callable)."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Sequence[Any | None]) -> list[Any | None]:
        """Keras 2 (tf-keras) API: `grads` unscaled, each in its dtype, as this replica's next
        `apply` then takes them. Not for float8 layers (their new scales would be divided too).
        """
        self._loss_scale_steps.check_readable(self.dynamic_scale, "get_unscaled_gradients")
        self._handed_over.put(unscaled=True)
        if current.is_jax():
            scale = ops.convert_to_tensor(self.dynamic_scale)
            return [None if g is None else ops.cast(ops.divide(g, scale), g.dtype) for g in grads]
        from mpt_keras.backend.tensorflow.step_verdict import unscaled_like

        return [None if g is None else unscaled_like(g, self.dynamic_scale) for g in grads]

    def model_train_step(self, model_name: str) -> contextlib.AbstractContextManager[StepVerdict]:
        """A model's train step runs inside (see `compile_hook`): an `apply` there of a loss
        never scaled (no `scale_loss`) applies the gradients undivided, with a warning; the
        `StepVerdict` says whether its `apply` skipped a bad batch."""
        return self._loss_scale_steps.step(model_name)

    def hand_over_batch(self, batch: Any, state: Sequence[keras.Variable] = ()) -> None:
        """Gives this replica's next `apply` the batch, and the `state` to put back on a skip."""
        self._handed_over.put(batch=batch, state=state_before(state))

    def apply(
        self,
        grads: Sequence[Any | None],
        trainable_variables: Sequence[keras.Variable] | None = None,
        *,
        loss: Any = None,
        batch: Any = None,
        state: Sequence[tuple[keras.Variable, Any]] | None = None,
    ) -> Any:
        """Applies one step: unscale, judge, then the inner `apply()` or a skip.

        `loss`, `batch`: this replica's unscaled loss and batch unless handed over
        (`scale_loss`, `hand_over_batch`); a NaN or Inf in either makes a bad batch. `state`:
        `state_before(variables)` of what the forward pass updates, put back on a skip.
        Returns whether the step was a bad batch on any replica (a bool tensor).
        """
        if current.in_cross_replica_context():
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
        handed_over = self._handed_over.take()
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
        unscaled = caller_unscaled(self, handed_over.get("unscaled", False), variables)
        unscaled = unscaled or self._loss_scale_steps.never_scaled(self)
        if current.is_jax():
            step = stateless_step.apply_eagerly
        else:
            from mpt_keras.scaling.step import run_step as step
        bad = step(
            self, self._own_variables(), grads, variables, loss, batch, list(state), unscaled
        )
        self._loss_scale_steps.judged(bad)
        return bad

    def _own_variables(self) -> OwnVariables:
        accumulation = None
        if self.built and self._accumulation_steps:
            accumulation = Accumulation(
                accumulators=list(self._accumulators),
                accumulated=self._accumulated_counter,
                micro_batches=self._micro_batches,
                steps=self._accumulation_steps,
            )
        return OwnVariables(
            scale=ScaleVariables(self.dynamic_scale, self.step_counter, self._overflow_counter),
            skipped=self._skipped_counter,
            nonfinite=self._nonfinite_counter if self.built else None,
            bad_batches=self._bad_batch_counter,
            bad_batch_ring=self._bad_batch_ring,
            last_loss=self._last_loss,
            half_squared_norm=self._half_squared_norm,
            model=self._built_on if self.built else None,
            accumulation=accumulation,
        )

    def stateless_apply(
        self,
        optimizer_variables: Sequence[Any],
        grads: Sequence[Any],
        trainable_variables: Sequence[Any],
        *,
        loss: Any = None,
        batch: Any = None,
    ) -> tuple[list[Any], list[Any]]:
        """The new trainable and optimizer values of one step (Keras' JAX trainer calls it);
        `loss` and `batch` as in `apply`. On TensorFlow, the base class's (which refuses)."""
        if not current.is_jax():
            # Past the stock one, which would move the scale, unbounded, before failing.
            return super(_StockLossScaleOptimizer, self).stateless_apply(
                optimizer_variables, grads, trainable_variables
            )
        if not self.built:
            raise ValueError(
                "To call `stateless_apply`, the optimizer must be built: call "
                "`optimizer.build(trainable_variables)` first."
            )
        unscaled = caller_unscaled(
            self, self._handed_over.take_unscaled(), self._built_on.variables
        )
        unscaled = unscaled or self._loss_scale_steps.never_scaled(self)
        own, values = self._own_variables(), (optimizer_variables, grads, trainable_variables)
        return stateless_step.stateless_step(
            self, own, *values, loss=loss, batch=batch, unscaled=unscaled
        )

    def stateless_skipped(
        self, before: Sequence[Any], after: Sequence[Any], *, bad_batch: bool = False
    ) -> Any:
        """Whether the step from optimizer values `before` to `after` was skipped (a bool
        tensor): the train step then keeps the forward pass's state as it was; with
        `bad_batch`, skipped as a bad batch (its metrics too)."""
        return stateless_step.step_skipped(self, self._own_variables(), before, after, bad_batch)

    def get_config(self) -> dict[str, Any]:
        # The stock keys (`dynamic_growth_steps` among them), then ours.
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
