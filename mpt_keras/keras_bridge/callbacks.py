"""Keras callbacks that know the global train step.

Ours need the run's global step (which survives restarts), not Keras' batch index: the
optimizer's `iterations`, read when `fit` starts and then counted on the host, so no
callback syncs with the device per step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import keras

_LOGGER = logging.getLogger(__name__)


def crossed(previous_step: int, step: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (previous_step, step]."""
    return step // every > previous_step // every


class GlobalStepCallback(keras.callbacks.Callback):
    """Base callback keeping `self.global_step`, the train steps done so far: exact when every
    step advances the optimizer's `iterations` (ours does, skipped steps included) and `fit`
    runs one step per batch index."""

    def __init__(self):
        super().__init__()
        self.global_step = 0
        self._epoch_start_step = 0

    def on_train_begin(self, logs=None):
        self.global_step = int(self.model.optimizer.iterations.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start_step = self.global_step

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, `batch` is the index of the last step run.
        self.global_step = self._epoch_start_step + batch + 1

    def is_older_batch(self, batch: int) -> bool:
        """Whether `batch` ends no later than the steps counted already: a callback run on
        worker threads (`async_safe`) may get a batch's hook after a later batch's."""
        return self._epoch_start_step + batch + 1 <= self.global_step


class WorkerHookCallback(GlobalStepCallback):
    """A `GlobalStepCallback` whose batch hook may run on Keras' worker thread, behind the
    steps, on every backend (`async_safe`), while its reads of the model run on the thread
    running `fit`: on JAX, reading the model syncs its state (`jax_state_sync`), which on a
    worker would race the next step's donated buffers; a hook run in step pays a wait for the
    device every step.

    Subclasses set `read_every` and implement `after_batch` (each step's work on its logs, on
    any thread, no reads of the model) and `read_model` (on `fit`'s thread once a multiple of
    `read_every` steps is done, after the worker handled that step, before the next one
    runs: the model's state and the last logs are that step's; and at training's end after
    the steps since the last read, unless `read_at_end` is False). Keras runs hooks on a
    worker where its backend is thread safe (JAX, not TensorFlow) and every callback with a
    batch hook is `async_safe`.
    """

    async_safe = True
    read_every = 1
    read_at_end = True

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()  # Keras' workers may run two batch hooks at once.
        self._handled = threading.Condition()
        self._handled_step = 0  # The last step whose batch hook is done.
        self._read_step = 0  # The step the model was last read at (or training began).
        self._fit_thread: int | None = None

    def after_batch(self, previous_step: int, logs: dict[str, Any]) -> None:
        """A batch's work on its logs, maybe on a worker: `self.global_step` is the batch's
        last step, `previous_step` the one before its first."""

    def read_model(self, previous_read_step: int) -> None:
        """Reads of the model, on `fit`'s thread (see the class): `self.global_step` is the
        step read at, `previous_read_step` the last read's (or training's start)."""

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._fit_thread = threading.get_ident()
        self._handled_step = self._read_step = self.global_step

    def on_train_batch_begin(self, batch, logs=None):
        self._catch_up(self._epoch_start_step + batch)

    def on_train_batch_end(self, batch, logs=None):
        step = self._epoch_start_step + batch + 1
        try:
            with self._lock:
                if self.is_older_batch(batch):  # A later batch's hook ran first.
                    return
                previous_step = self.global_step
                super().on_train_batch_end(batch, logs)
                self.after_batch(previous_step, logs or {})
        finally:
            with self._handled:
                self._handled_step = max(self._handled_step, step)
                self._handled.notify_all()
        if threading.get_ident() == self._fit_thread:  # Keras runs the hooks in step.
            self._catch_up(step)

    def on_epoch_end(self, epoch, logs=None):
        self._catch_up(self.global_step)

    def on_train_end(self, logs=None):
        if self.read_at_end and self.global_step > self._read_step:  # Steps since the last.
            self._read(self.global_step)

    def _catch_up(self, step: int) -> None:
        """`read_model` if a multiple of `read_every` lies in the steps since the last read;
        `step`: the steps done so far (on `fit`'s thread)."""
        if not crossed(self._read_step, step, self.read_every):
            return
        with self._handled:
            self._handled.wait_for(lambda: self._handled_step >= step)
        self._read(step)

    def _read(self, step: int) -> None:
        previous, self._read_step = self._read_step, step
        with self._lock:
            self.read_model(previous)


class StopAtStep(GlobalStepCallback):
    """Stops `model.fit` once the global step reaches `last_step`, the run's total."""

    def __init__(self, last_step: int):
        super().__init__()
        self.last_step = last_step

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self.global_step >= self.last_step:
            self.model.stop_training = True


class IntervalProgbar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar whose total is the steps each interval really runs.

    A run's epochs are `checkpoint_every` steps and it stops at `last_step` (`StopAtStep`),
    so its last (or only) interval may run fewer steps than an epoch: the stock bar would
    still say `100/100` after 60 steps.
    """

    def __init__(self, last_step: int):
        super().__init__()
        self.last_step = last_step
        self._step = 0

        self._steps_per_epoch = 1

    def set_params(self, params):
        super().set_params(params)
        self._steps_per_epoch = params["steps"]

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._step = int(self.model.optimizer.iterations.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        # fit runs only while steps remain, so an epoch starts before last_step.
        self.target = min(self._steps_per_epoch, self.last_step - self._step)
        super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._step += self.target
        super().on_epoch_end(epoch, logs)


class SaveCheckpoints(GlobalStepCallback):
    """Saves a checkpoint at each Keras epoch's (checkpoint interval's) end in `fit`, unless
    `healthy()` is False (then warns). `checkpointer`: any with `save(step) -> path`."""

    def __init__(self, checkpointer: Any, healthy: Callable[[], bool] | None = None):
        super().__init__()
        self._checkpointer = checkpointer
        self._healthy = healthy

    def on_epoch_end(self, epoch, logs=None):
        if self._healthy is not None and not self._healthy():
            _LOGGER.warning(
                "Step %d: the loss is unhealthy, no checkpoint saved.", self.global_step
            )
            return
        path = self._checkpointer.save(self.global_step)
        _LOGGER.info("Step %d: saved %s.", self.global_step, path)
