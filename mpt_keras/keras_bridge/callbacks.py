"""Keras callbacks that know the global train step.

Ours need the run's global step (which survives restarts), not Keras' batch index: the
optimizer's `iterations`, read when `fit` starts and then counted on the host, so no
callback syncs with the device per step.
"""

from __future__ import annotations

import collections
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
    runs one step per batch index.

    Its batch hook may run on Keras' worker threads, behind the steps (`async_safe`); a
    subclass whose batch hook reads the model sets `async_safe = False` (on JAX a read there
    would race the next step), or reads on `fit`'s thread (`WorkerHookCallback`).
    """

    async_safe = True

    def __init__(self):
        super().__init__()
        self.global_step = 0
        self._epoch_start_step = 0
        self._steps_per_batch = 1  # `steps_per_execution`: Keras' batch indices jump by it.
        self._count_lock = threading.Lock()

    def on_train_begin(self, logs=None):
        self.global_step = int(self.model.optimizer.iterations.numpy())
        self._steps_per_batch = int(self.model.steps_per_execution)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start_step = self.global_step

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, `batch` is the index of the last step run. Hooks run
        # on Keras' workers (`async_safe`) may come out of order: the count never goes back.
        with self._count_lock:
            self.global_step = max(self.global_step, self._epoch_start_step + batch + 1)


class WorkerHookCallback(GlobalStepCallback):
    """A `GlobalStepCallback` whose batch hook may run on Keras' worker thread, behind the
    steps, on every backend (`async_safe`), while its reads of the model run on the thread
    running `fit`: on JAX, reading the model syncs its state (`jax_state_sync`), which on a
    worker would race the next step's donated buffers; a hook run in step pays a wait for the
    device every step.

    Subclasses set `read_every` and implement `after_batch` (each batch's work on its logs,
    in step order, on any thread, no reads of the model) and `read_model` (on `fit`'s thread
    once a multiple of `read_every` steps is done, after the worker handled that step, before
    the next one runs: the model's state and the last logs are that step's; at each epoch's
    end if `read_at_epoch_end`; and at training's end after the steps since the last read,
    unless `read_at_end` is False). Work a step's logs call for that reads the model goes to
    `on_fit_thread`. Keras runs hooks on a worker where its backend is thread safe (JAX, not
    TensorFlow) and every callback with a batch hook is `async_safe`.

    `hook_wait_seconds`: how long a read waits for a step's hook: it comes unless an earlier
    callback's hook for that batch raised (Keras raises it at the next batch's end); then
    the read goes on, with a warning.
    """

    read_every = 1
    read_at_epoch_end = False
    read_at_end = True
    hook_wait_seconds = 60.0

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()  # Keras' workers may run two batch hooks at once.
        self._handled = threading.Condition()  # Notified as batches are handled.
        self._read_step = 0  # The step the model was last read at (or training began).
        self._arrived: dict[int, tuple[int, dict[str, Any]]] = {}  # By last step: not handled.
        self._fit_thread: int | None = None
        self._fit_thread_work: collections.deque[Callable[[], None]] = collections.deque()

    def after_batch(self, previous_step: int, logs: dict[str, Any]) -> None:
        """A batch's work on its logs, maybe on a worker: `self.global_step` is the batch's
        last step, `previous_step` the one before its first."""

    def read_model(self, previous_read_step: int) -> None:
        """Reads of the model, on `fit`'s thread (see the class): `self.global_step` is the
        step read at, `previous_read_step` the last read's (or training's start)."""

    def on_fit_thread(self, work: Callable[[], None]) -> None:
        """Runs `work` (which may read the model) on `fit`'s thread: now when the batch hook
        runs there, else at the next batch start after this (or the epoch's or training's
        end)."""
        if threading.get_ident() == self._fit_thread:
            work()
        else:
            self._fit_thread_work.append(work)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._fit_thread = threading.get_ident()
        self._fit_thread_work.clear()
        self._arrived.clear()
        self._read_step = self.global_step

    def on_train_batch_begin(self, batch, logs=None):
        self._catch_up(self._epoch_start_step + batch)

    def on_train_batch_end(self, batch, logs=None):
        with self._lock:
            self._arrived[self._epoch_start_step + batch + 1] = (batch, logs or {})
            self._handle_arrived(gaps=False)
        if threading.get_ident() == self._fit_thread:  # Keras runs the hooks in step.
            self._catch_up(self.global_step)

    def on_epoch_end(self, epoch, logs=None):
        self._catch_up(self.global_step)  # Keras has waited for the epoch's hooks.
        if self.read_at_epoch_end and self.global_step > self._read_step:
            self._read(self.global_step)

    def on_train_end(self, logs=None):
        self._run_fit_thread_work()  # Keras has waited for every hook.
        if self.read_at_end and self.global_step > self._read_step:  # Steps since the last.
            self._read(self.global_step)

    def _handle_arrived(self, gaps: bool) -> None:
        """Hands the batches arrived to `after_batch` in step order (Keras' workers may run a
        later batch's hook first), stopping at a missing one unless `gaps`. Under `_lock`."""
        try:
            while self._arrived:
                last_step = min(self._arrived)
                batch, logs = self._arrived[last_step]
                if last_step > self.global_step + self._steps_per_batch and not gaps:
                    return
                del self._arrived[last_step]
                if last_step <= self.global_step:  # Came after a gap was passed: too late.
                    continue
                previous_step = self.global_step
                super().on_train_batch_end(batch, logs)
                self.after_batch(previous_step, logs)
        finally:
            with self._handled:
                self._handled.notify_all()

    def _catch_up(self, step: int) -> None:
        """On `fit`'s thread, `step` the steps done so far: the work handed to `on_fit_thread`,
        and `read_model` if a multiple of `read_every` lies in the steps since the last read
        (after waiting for the worker to have handled `step`)."""
        read = crossed(self._read_step, step, self.read_every)
        if read:
            # Counted as its handling starts; the work and the read below take `_lock`, so
            # they follow the end of its `after_batch`.
            with self._handled:
                came = self._handled.wait_for(
                    lambda: self.global_step >= step, timeout=self.hook_wait_seconds
                )
            if not came:
                _LOGGER.warning(
                    "%s: the batch hooks up to step %d did not come in %g s (did another "
                    "callback's batch hook raise?); going on without the missing ones.",
                    type(self).__name__,
                    step,
                    self.hook_wait_seconds,
                )
                with self._lock:
                    self._handle_arrived(gaps=True)
        self._run_fit_thread_work()
        if read:
            self._read(step)

    def _run_fit_thread_work(self) -> None:
        with self._lock:
            while self._fit_thread_work:
                self._fit_thread_work.popleft()()

    def _read(self, step: int) -> None:
        previous, self._read_step = self._read_step, step
        with self._lock:
            self.read_model(previous)


class StopAtStep(GlobalStepCallback):
    """Stops `model.fit` once the global step reaches `last_step`, the run's total.

    Decided as the batch that reaches it begins (`fit` stops after that batch): its batch
    hook may run behind the steps, where a stop would come steps late.
    """

    def __init__(self, last_step: int):
        super().__init__()
        self.last_step = last_step

    def on_train_batch_begin(self, batch, logs=None):
        # The batch's last step, as `on_train_batch_end` will count it.
        if self._epoch_start_step + batch + self._steps_per_batch >= self.last_step:
            self.model.stop_training = True


class IntervalProgbar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar whose total is the steps each interval really runs.

    A run's epochs are `checkpoint_every` steps and it stops at `last_step` (`StopAtStep`),
    so its last (or only) interval may run fewer steps than an epoch: the stock bar would
    still say `100/100` after 60 steps. Its batch hook may run behind the steps, as Keras'
    own bar's does (`async_safe`).
    """

    async_safe = True

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
