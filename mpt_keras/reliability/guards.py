"""Guards that stop, or roll back, a run whose data or loss goes wrong.

`BadBatchLimit` reports skipped bad batches, stopping the run past a limit. `DivergenceGuard`
raises `Diverged` inside `fit`, so no diverged checkpoint is saved; `runs.fit_loop` rolls back
with a lower learning rate (`ScaledLearningRate`) or promoted layers, or stops. Each check
reads one scalar from the device.

Example:

    model.fit(dataset, callbacks=[BadBatchLimit(10), DivergenceGuard(patience=20)])
"""

from __future__ import annotations

import logging
import math
from typing import Any

import keras

from mpt_keras.checks import refusal
from mpt_keras.errors import RunStoppedError
from mpt_keras.keras_bridge.callbacks import GlobalStepCallback, WorkerHookCallback
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_LOGGER = logging.getLogger(__name__)


def loss_scale_optimizer(model: keras.Model, who: str) -> LossScaleOptimizer:
    """`model.optimizer`, which `who` (a callback) needs to be ours; else `UserInputError`."""
    optimizer = model.optimizer
    if not isinstance(optimizer, LossScaleOptimizer):
        raise refusal(
            f"{who} model.optimizer", type(optimizer).__name__, "mpt_keras.LossScaleOptimizer"
        )
    return optimizer


class Diverged(Exception):
    """Raised inside `model.fit` by `DivergenceGuard`; carries what it saw."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"step {step}: {reason}")
        self.step = step
        self.reason = reason


class BadBatchLimit(WorkerHookCallback):
    """Reports skipped bad batches by step; stops the run past `max_bad_batches`.

    `max_bad_batches`: batches with NaN or Inf in inputs, labels or weights a run may skip;
    one more raises `RunStoppedError`. Checks at multiples of `check_every` steps and at each
    epoch's end, on `fit`'s thread (its batch hook may run behind the steps).
    """

    read_at_epoch_end = True

    def __init__(self, max_bad_batches: int, check_every: int = 10):
        super().__init__()
        self.max_bad_batches = max_bad_batches
        self.check_every = self.read_every = check_every
        self.reported: list[int] = []
        self._known = 0

    def on_train_begin(self, logs=None):
        optimizer = loss_scale_optimizer(self.model, "BadBatchLimit")
        super().on_train_begin(logs)
        # Bad batches before a restart were reported by the run that met them.
        self._known = optimizer.bad_batches

    def read_model(self, previous_read_step):
        self._check()

    def _check(self) -> None:
        health = self.model.optimizer.health()
        count = health.bad_batches
        if count == self._known:
            return
        steps = list(health.bad_batch_steps[-(count - self._known) :])
        self._known = count
        self.reported.extend(steps)
        _LOGGER.warning(
            "Skipped %d batch(es) with NaN or Inf inputs, labels or weights at step(s) %s "
            "(%d in the run).",
            len(steps),
            ", ".join(map(str, steps)),
            count,
        )
        if count > self.max_bad_batches:
            raise RunStoppedError(
                f"{count} train batches held NaN or Inf values (the latest at step "
                f"{steps[-1]}), more than data.max_bad_batches={self.max_bad_batches}: fix "
                "the data or raise the limit; the weights never saw them and the last "
                "checkpoint is kept"
            )


class DivergenceGuard(GlobalStepCallback):
    """Raises `Diverged` after `patience` steps in a row with a bad loss.

    A loss (`LossScaleOptimizer.last_loss`) is bad if non-finite or above `max_loss` (None: no
    limit); bad-data skips count neither way. It reads the loss each step, in step (so Keras
    runs every batch hook in step).
    """

    async_safe = False

    def __init__(self, patience: int, max_loss: float | None = None):
        super().__init__()
        self.patience = patience
        self.max_loss = max_loss
        self._streak = 0
        self._bad_batches = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._streak = 0
        self._bad_batches = self.model.optimizer.bad_batches

    def healthy(self) -> bool:
        """Whether the last step's loss was good (a checkpoint now is safe)."""
        return self._streak == 0

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        optimizer = self.model.optimizer
        bad_batches = optimizer.bad_batches
        if bad_batches != self._bad_batches:
            self._bad_batches = bad_batches
            return
        loss = optimizer.last_loss
        exploded = self.max_loss is not None and loss > self.max_loss
        self._streak = self._streak + 1 if not math.isfinite(loss) or exploded else 0
        if self._streak >= self.patience:
            limit = "" if self.max_loss is None else f" or above {self.max_loss:g}"
            raise Diverged(
                self.global_step,
                f"the loss was non-finite{limit} for {self._streak} steps in a row "
                f"(last: {loss:g})",
            )


@keras.saving.register_keras_serializable(package="mpt_keras")
class ScaledLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """A learning rate (a float or a schedule) times a scale that can be lowered mid-run.

    The scale is a variable (lowering it needs no retrace); checkpoint it with the run.
    """

    def __init__(
        self,
        learning_rate: float | keras.optimizers.schedules.LearningRateSchedule,
        scale: float = 1.0,
    ):
        self.learning_rate = learning_rate
        self.scale = keras.Variable(scale, dtype="float32", trainable=False, name="lr_scale")

    def __call__(self, step: Any) -> Any:
        base = self.learning_rate
        value = base(step) if callable(base) else base
        return keras.ops.cast(value, "float32") * self.scale

    def get_config(self) -> dict[str, Any]:
        base = self.learning_rate
        return {
            "learning_rate": keras.saving.serialize_keras_object(base)
            if isinstance(base, keras.optimizers.schedules.LearningRateSchedule)
            else base,
            # Not ops.convert_to_numpy: see scaling/readings.read.
            "scale": float(self.scale.numpy()),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ScaledLearningRate:
        base = config["learning_rate"]
        if isinstance(base, dict):
            base = keras.saving.deserialize_keras_object(base)
        return cls(base, config["scale"])
