"""`MixedPrecisionMonitor`: a run's TensorBoard telemetry.

Train scalars every `update_freq` steps and at `fit`'s end under `log_dir/train`, sample-batch
histograms every `histogram_freq` steps, validation under `log_dir/validation` (Keras'
layout), the dashboard in `log_dir`. Tags: `layout`; meanings: docs/telemetry.md.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mpt_keras.backend import current
from mpt_keras.checks import check_number, refusal
from mpt_keras.keras_bridge.callbacks import WorkerHookCallback, crossed
from mpt_keras.precision.float8 import float8_statistics, float8_variables
from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry import layout as tags
from mpt_keras.telemetry.optimizer_scalars import add_optimizer_scalars
from mpt_keras.telemetry.overflow_report import describe_overflow, new_nonfinite

_LOGGER = logging.getLogger("mpt_keras.telemetry.monitor")


class MixedPrecisionMonitor(WorkerHookCallback):
    """A Keras callback writing mixed-precision telemetry for TensorBoard (see the module).

    No wait for the device per step: Keras may run its batch hook on a worker thread, behind
    the steps (`WorkerHookCallback`); the model is read at a write, on `fit`'s thread, and a
    step's values are what it logged. A diagnosis runs on `fit`'s thread too, at the first
    batch start after the hook flagged its step (the weights then may include the steps
    since; a skipped step changes none). Step time leaves out each epoch's first batch
    (tracing) and between-epoch time. Only the chief writes.

    Args:
        histogram_freq: Steps between histograms; 0: none.
        histogram_data: `(x, y)` for the histograms (callbacks do not see the train data);
            required with `histogram_freq`.
        examples_per_step: Global batch size, for `examples_per_second`.
        diagnosis_data: A batch `(x, y[, sample_weight])` or step -> batch function,
            diagnosed (`diagnose_nonfinite`: a WARNING, a `nonfinite_diagnosis` event) when a
            step skips a bad batch, overflows at the scale's floor or its loss turns
            non-finite; at most once per `diagnosis_every` steps.

    Raises:
        UserInputError: A count out of range, or `histogram_freq` without `histogram_data`.

    Example: `model.fit(x, y, callbacks=[MixedPrecisionMonitor("/tmp/logs", update_freq=2)])`.
    """

    def __init__(
        self,
        log_dir: str,
        update_freq: int = 10,
        histogram_freq: int = 0,
        histogram_data: tuple[Any, Any] | None = None,
        examples_per_step: int | None = None,
        diagnosis_data: tuple[Any, ...] | Callable[[int], tuple[Any, ...]] | None = None,
        diagnosis_every: int = 100,
    ):
        super().__init__()
        _check_count("update_freq", update_freq, minimum=1)
        _check_count("histogram_freq", histogram_freq, minimum=0)
        _check_count("diagnosis_every", diagnosis_every, minimum=1)
        if examples_per_step is not None:
            _check_count("examples_per_step", examples_per_step, minimum=1)
        if histogram_freq and histogram_data is None:
            raise refusal(
                "histogram_data",
                "None",
                f"(x, y), a batch to take the histograms on, with histogram_freq={histogram_freq}",
            )
        if current.is_jax() and histogram_freq:
            raise refusal(
                "MixedPrecisionMonitor on Keras' JAX backend",
                f"histogram_freq={histogram_freq}",
                "histogram_freq=0: the histograms trace the model with TensorFlow "
                "(docs/backends.md)",
            )
        self.log_dir = log_dir
        self.update_freq = self.read_every = update_freq
        self.histogram_freq = histogram_freq
        self.histogram_data = histogram_data
        self.examples_per_step = examples_per_step
        self.diagnosis_data = diagnosis_data
        self.diagnosis_every = diagnosis_every
        self._last_diagnosis: int | None = None
        self._summaries = summary_files(log_dir)
        self._is_writer = True
        self._layout_written = False
        self._float8 = False  # Whether the model has float8 layers.
        self._sample_pass: Any = None  # sample_statistics.SamplePass, made on first use.
        self._add_optimizer_scalars: Any = None  # For the model's optimizer, made on first use.
        self._memory_devices: list[str] = []
        self._last_logs: dict[str, Any] = {}
        self._min_scale: float | None = None  # The loss scale's floor, if ours scales.
        self._last_batch_end: float | None = None
        # What the current interval started from.
        self._skipped_steps = 0
        self._bad_batches = 0
        self._nonfinite_counts: dict[str, int] = {}
        self._timed_seconds = 0.0
        self._timed_steps = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._is_writer = current.is_chief(self.model)
        if not self._is_writer:
            return
        self._float8 = bool(float8_variables(self.model))
        if not self._layout_written:
            tags.write_layout(self._summaries, bool(self.histogram_freq), self._float8)
            self._layout_written = True
        if self.histogram_freq and self._sample_pass is None:
            from mpt_keras.telemetry.sample_statistics import sample_pass

            self._sample_pass = sample_pass(self.model)
        self._memory_devices = _memory_tracking_devices()
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            self._min_scale = optimizer.min_scale
            self._skipped_steps = optimizer.skipped_steps
            self._bad_batches = optimizer.bad_batches
            self._nonfinite_counts = optimizer.nonfinite_counts()
        self._start_interval()

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._last_batch_end = None  # The time between epochs (validation) is not a step's.

    def after_batch(self, previous_step, logs):
        if not self._is_writer:
            return
        now = time.perf_counter()
        if self._last_batch_end is not None:
            self._timed_seconds += now - self._last_batch_end
            self._timed_steps += self.global_step - previous_step
        self._last_batch_end = now
        previous_logs, self._last_logs = self._last_logs, logs
        if self.diagnosis_data is not None and self._went_wrong(previous_logs):
            self._diagnosis_due()
        if self.histogram_freq and crossed(previous_step, self.global_step, self.histogram_freq):
            self.on_fit_thread(functools.partial(self._write_histograms, self.global_step))

    def read_model(self, previous_read_step):
        if self._is_writer:
            self._write_interval(previous_read_step)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        validation = {
            name.removeprefix("val_"): value
            for name, value in (logs or {}).items()
            if name.startswith("val_")
        }
        if validation and self._is_writer:
            self._summaries.write_scalars("validation", self.global_step, validation)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)  # Writes the steps since the last write: all overflows.
        if self._is_writer:
            self._summaries.flush()

    def _went_wrong(self, previous_logs: dict[str, Any]) -> bool:
        """Whether the step skipped (bad batch, scale's floor) or its loss went non-finite."""
        logs = self._last_logs  # Not the model: this may run on a worker.
        if "loss" in logs and not math.isfinite(float(logs["loss"])):
            if math.isfinite(float(previous_logs.get("loss", 0.0))):
                return True
        skipped = logs.get(tags.SKIPPED_STEPS, 0.0) > previous_logs.get(tags.SKIPPED_STEPS, 0.0)
        if not skipped or self._min_scale is None:
            return False
        bad_batch = logs.get(tags.BAD_BATCHES, 0.0) > previous_logs.get(tags.BAD_BATCHES, 0.0)
        return bad_batch or logs.get(tags.LOSS_SCALE, math.inf) <= self._min_scale

    def _write_histograms(self, step: int) -> None:
        from mpt_keras.telemetry.sample_statistics import write_sample_statistics

        activations, gradients = self._sample_pass(*self.histogram_data)
        write_sample_statistics(self._summaries, step, activations, gradients)

    def _diagnosis_due(self) -> None:
        """Diagnoses this step's batch on `fit`'s thread, at most once per `diagnosis_every`."""
        step = self.global_step
        if self._last_diagnosis is not None and step - self._last_diagnosis < self.diagnosis_every:
            return
        self._last_diagnosis = step
        self.on_fit_thread(functools.partial(self._diagnose, step))

    def _diagnose(self, step: int) -> None:
        data = self.diagnosis_data
        batch = tuple(data(step) if callable(data) else data)
        from mpt_keras.telemetry.diagnosis import describe_for_log, diagnose_nonfinite

        line = describe_for_log(step, diagnose_nonfinite(self.model, *batch[:2]))
        _LOGGER.warning("%s", line)
        self._summaries.text("train", step, tags.NONFINITE_DIAGNOSIS, line)

    def _start_interval(self) -> None:
        self._timed_seconds = 0.0
        self._timed_steps = 0
        if self._memory_devices:
            from mpt_keras.backend.tensorflow import memory

            memory.reset_peaks(self._memory_devices)

    def _write_interval(self, start_step: int) -> None:
        """Writes the steps after `start_step` up to this one."""
        scalars = dict(self._last_logs)
        if self._timed_steps:
            step_time = self._timed_seconds / self._timed_steps
            scalars[tags.STEP_TIME] = step_time
            if self.examples_per_step:
                scalars[tags.EXAMPLES_PER_SECOND] = self.examples_per_step / step_time
        if self._memory_devices:
            from mpt_keras.backend.tensorflow import memory

            for device, peak in memory.peaks_mib(self._memory_devices).items():
                scalars[tags.PEAK_MEMORY + device] = peak
        if self._float8:
            for path, statistics in float8_statistics(self.model).items():
                for name, value in statistics.scalars().items():
                    scalars[tags.float8_tag(path, name)] = value
        optimizer = self.model.optimizer
        interval = (self._skipped_steps, self.global_step - start_step)
        skipped = self._summaries.write_scalars(
            "train", self.global_step, scalars, self._optimizer_scalars(optimizer), interval
        )
        if isinstance(optimizer, LossScaleOptimizer):
            skipped = int(skipped)
            # Bad batches are skipped too, but are no overflow (guards report them).
            bad = int(float(self._last_logs.get(tags.BAD_BATCHES, self._bad_batches)))
            overflows = skipped - self._skipped_steps - (bad - self._bad_batches)
            if overflows > 0:
                self._report_overflow(optimizer, overflows, start_step)
            self._skipped_steps, self._bad_batches = skipped, bad
        self._start_interval()

    def _optimizer_scalars(self, optimizer: Any) -> Any:
        """`add_optimizer_scalars` for `optimizer`, one function per optimizer: a summary
        writer traces a write per function (on TensorFlow)."""
        made = self._add_optimizer_scalars
        if made is None or made.args[0] is not optimizer:
            made = functools.partial(add_optimizer_scalars, optimizer)
            self._add_optimizer_scalars = made
        return made

    def _report_overflow(
        self, optimizer: LossScaleOptimizer, skipped: int, start_step: int
    ) -> None:
        counts = optimizer.nonfinite_counts()
        new = new_nonfinite(self._nonfinite_counts, counts)
        self._nonfinite_counts = counts
        line, report = describe_overflow(new, counts, skipped, start_step + 1, self.global_step)
        _LOGGER.warning("%s", line)
        # Eagerly: the set of tags changes from one event to the next.
        self._summaries.text("train", self.global_step, tags.NONFINITE_TEXT, report)
        for path in new:
            self._summaries.scalar("train", self.global_step, tags.NONFINITE + path, counts[path])


def _check_count(what: str, value: Any, minimum: int) -> None:
    # numpy integers count as integers.
    count = int(value) if isinstance(value, np.integer) else value
    check_number(what, count, minimum=minimum, integer=True)


def summary_files(log_dir: str) -> Any:
    """The log directory's summary writers: `backend.tensorflow.summaries.SummaryWriters` on
    TensorFlow, `event_files.EventFiles` on JAX (one interface)."""
    if current.is_jax():
        from mpt_keras.telemetry.event_files import EventFiles

        return EventFiles(log_dir)
    from mpt_keras.backend.tensorflow.summaries import SummaryWriters

    return SummaryWriters(log_dir)


def _memory_tracking_devices() -> list[str]:
    """TensorFlow's devices that keep memory statistics; none on JAX (which cannot reset a
    device's peak per interval)."""
    if current.is_jax():
        return []
    from mpt_keras.backend.tensorflow import memory

    return memory.tracking_devices()
