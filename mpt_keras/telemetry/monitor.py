"""TensorBoard telemetry of a mixed-precision training run.

`MixedPrecisionMonitor` writes, keyed by the global train step, under
`log_dir/train` (every `update_freq` steps, and at the end of `fit`):

    loss, <metric>              running mean over the current Keras epoch
    learning_rate               the inner optimizer's current learning rate
    loss_scale                  the loss scale (a `LossScaleOptimizer`'s)
    skipped_steps               steps skipped so far for non-finite gradients
    bad_batches                 of those, steps whose batch or loss held NaN/Inf
    overflow_rate               skipped / steps, over the interval
    nonfinite/<variable path>   steps so far whose gradient of that variable was
                                non-finite; at the intervals where it was
    nonfinite_gradients         (text) at each such interval: the steps, layers
                                and variables; also logged as a WARNING
    nonfinite_diagnosis         (text) with `diagnosis_data`, where a step went
                                wrong: the first non-finite layer output or
                                gradient (`diagnose_nonfinite`); also a WARNING
    gradient_norm               global norm of the last step's unscaled
                                gradients (a `mpt_keras.LossScaleOptimizer`)
    step_time_seconds           mean wall time of the interval's train steps
    examples_per_second         `examples_per_step` / step time
    peak_memory_mib/<device>    peak memory of each device over the interval
    float8/<layer>/<tensor>/<statistic>
                                for each float8 layer (`precision.float8`), of
                                its inputs, kernel and outputs_grad: the scale,
                                the amax of the last step and the range used;
                                and its kernel's saturated and underflowed
                                shares (`float8_statistics`); only for a model
                                with float8 layers

every `histogram_freq` steps, from a forward/backward pass on `histogram_data`:

    activation_log2_magnitude/<layer>, gradient_log2_magnitude/<variable path>
        histograms of log2|x| (zeros and non-finite values left out); float16
        normals span [-14, 16), subnormals reach -24; not for float8 scales and
        amax histories, whose "gradients" are their new values
    activation_above_float16_max/<layer>, gradient_above_float16_max/<variable>
        fraction of values above 65504 or non-finite
    activation_below_float16_normal/<layer>, gradient_below_float16_normal/...
        fraction of nonzero values below 2**-14 (6.1e-5)

and `validation/loss`, ... at each validation, under `log_dir/validation` (the
layout of Keras' TensorBoard callback, so train and validation curves share a
chart). `log_dir` itself holds the "Mixed precision" custom-scalars dashboard.

Why one module: every series above is written by one callback at the same
step boundaries, from the same step logs and interval reads; the helpers
below are each used by it alone. The layout of the tags lives apart, in
`telemetry_layout`, since the Prometheus exporter and the dashboard read it
too, and the float8 statistics in `precision.float8`, which reads a model's.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras.keras_bridge.callbacks import GlobalStepCallback
from mpt_keras.precision.float8 import float8_statistics, float8_variables, is_float8_state
from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry import layout as tags
from mpt_keras.telemetry.diagnosis import describe_for_log, diagnose_nonfinite

FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 2.0**-14
_LOGGER = logging.getLogger("mpt_keras.telemetry.monitor")


class MixedPrecisionMonitor(GlobalStepCallback):
    """A Keras callback writing mixed-precision telemetry for TensorBoard.

    It reads optimizer and device state only every `update_freq` steps (and
    once at the start and end of `fit`), so it adds no host-device
    synchronisation to the other steps. The tags are listed in the module
    docstring.

    It is `async_safe`: it adds no sync to `fit`'s steps, so Keras may call
    its batch hook on a worker thread, behind the steps. What it writes for a
    step is what that step logged: with our optimizer, its loss scale,
    skipped steps, bad batches and gradient norm (`LossScaleOptimizer.
    step_logs`); the per-variable non-finite counts, the learning rate and
    the float8 statistics are read when the interval is written.

    Step time is the wall time between the ends of train batches as Keras
    reports them (with the batch's logs, so the step has finished), over the
    steps between them: the first batch of each epoch (tracing, compilation)
    and the time between epochs (validation) are left out. A step of a custom
    train loop that does not advance `optimizer.iterations` is not counted.

    Peak memory is `tf.config.experimental.get_memory_info(device)["peak"]`
    for each local device, reset at each write. TensorFlow 2.21 reports it for
    GPUs and TPUs, and for the CPU with its BFC allocator
    (`TF_CPU_ALLOCATOR_USE_BFC=true`, set by the `mpt-*` launchers) or
    oneDNN's (allocations of 256 KiB and more only); a device that does not
    track memory is left out.

    Under a `tf.distribute` strategy only the chief writes (the `chief` task,
    or `worker` 0 when the cluster has no chief); other workers write and log
    nothing. The values are the replica-consistent ones: mirrored variables
    read the same on every replica.

    Args:
        log_dir: Directory of the TensorBoard event files.
        update_freq: Steps between train summaries.
        histogram_freq: Steps between activation and gradient histograms; 0
            writes none.
        histogram_data: `(x, y)`, a batch for the histograms, required when
            `histogram_freq > 0` (Keras callbacks do not see the train data).
            Gradients are of the loss times the current loss scale, as in a
            train step; activations are the outputs of the model's top-level
            layers (functional and `Sequential` models only).
        examples_per_step: Global batch size, for `examples_per_second`; None
            writes step time only.
        diagnosis_data: What `diagnose_nonfinite` runs on when a step goes
            wrong (below): a batch `(x, y)` (or `(x, y, sample_weight)`: the
            weights are left out), or a function of a step that returns the
            batch that step trained on (`mpt-train` passes one:
            its data is a function of the step). None: no diagnosis.
        diagnosis_every: At most one diagnosis in this many steps.

    When a step is skipped for a bad batch, or for an overflow while the loss
    scale is at its floor (with a fixed scale, every overflow), or the logged
    loss turns non-finite, the monitor runs `mpt_keras.diagnose_nonfinite` on
    `diagnosis_data` and writes one WARNING line and a TensorBoard text event
    (`nonfinite_diagnosis`), e.g. `step 412: first non-finite output:
    block_1/attention/softmax (float16), input max 7.1e+04`.

    Example:

        import keras, numpy as np, mpt_keras

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = mpt_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=optimizer, loss="mse")
        monitor = mpt_keras.MixedPrecisionMonitor(
            "/tmp/run/logs", update_freq=2, examples_per_step=4)
        model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, callbacks=[monitor])
        # then: tensorboard --logdir /tmp/run/logs
    """

    # Keras dispatches the batch hooks of `fit` to a thread when every
    # callback with one says so: no sync per step.
    async_safe = True

    def __init__(
        self,
        log_dir: str,
        update_freq: int = 10,
        histogram_freq: int = 0,
        histogram_data: tuple[Any, Any] | None = None,
        examples_per_step: int | None = None,
        diagnosis_data: tuple[Any, Any] | Callable[[int], tuple[Any, Any]] | None = None,
        diagnosis_every: int = 100,
    ):
        super().__init__()
        _check_count("update_freq", update_freq, minimum=1)
        _check_count("histogram_freq", histogram_freq, minimum=0)
        _check_count("diagnosis_every", diagnosis_every, minimum=1)
        if examples_per_step is not None:
            _check_count("examples_per_step", examples_per_step, minimum=1)
        if histogram_freq and histogram_data is None:
            raise ValueError(
                f"histogram_freq={histogram_freq} needs histogram_data=(x, y), a batch to "
                "take the histograms on. Received: histogram_data=None"
            )
        self.log_dir = log_dir
        self.update_freq = update_freq
        self.histogram_freq = histogram_freq
        self.histogram_data = histogram_data
        self.examples_per_step = examples_per_step
        self.diagnosis_data = diagnosis_data
        self.diagnosis_every = diagnosis_every
        self._last_diagnosis: int | None = None
        self._writers: dict[str, tf.summary.SummaryWriter] = {}
        self._scalar_writers: dict[tuple[str, tuple[str, ...], int | None], Callable] = {}
        self._is_writer = True
        self._layout_written = False
        self._float8 = False  # Whether the model has float8 layers.
        self._probe: keras.Model | None = None
        self._sample_pass: Callable | None = None
        self._memory_devices: list[str] = []
        self._last_logs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._last_batch_end: float | None = None
        # What the current interval started from.
        self._interval_start_step = 0
        self._skipped_steps = 0
        self._bad_batches = 0
        self._nonfinite_counts: dict[str, int] = {}
        self._timed_seconds = 0.0
        self._timed_steps = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._is_writer = _is_chief(self.model.distribute_strategy)
        if not self._is_writer:
            return
        self._float8 = bool(float8_variables(self.model))
        if not self._layout_written:
            tags.write_layout(
                self._writer(""), histograms=bool(self.histogram_freq), float8=self._float8
            )
            self._layout_written = True
        if self.histogram_freq and self._sample_pass is None:
            self._probe = _activation_probe(self.model)
            self._sample_pass = tf.function(self._activations_and_gradients)
        self._memory_devices = _memory_tracking_devices()
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            self._skipped_steps = optimizer.skipped_steps
            self._bad_batches = optimizer.bad_batches
            self._nonfinite_counts = optimizer.nonfinite_counts()
        self._start_interval()

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._last_batch_end = None  # The time between epochs (validation) is not a step's.

    def on_train_batch_end(self, batch, logs=None):
        # Keras may call this on a worker thread, behind the steps, and two
        # calls at once (`async_safe`): a lock, and a batch that arrives after
        # a later one is dropped (its values are older).
        with self._lock:
            if self.is_older_batch(batch):
                return
            previous_step = self.global_step
            super().on_train_batch_end(batch, logs)
            if not self._is_writer:
                return
            now = time.perf_counter()
            if self._last_batch_end is not None:
                self._timed_seconds += now - self._last_batch_end
                self._timed_steps += self.global_step - previous_step
            self._last_batch_end = now
            previous_logs, self._last_logs = self._last_logs, logs or {}
            if self.diagnosis_data is not None and self._went_wrong(previous_logs):
                self._diagnose()
            if _crossed(previous_step, self.global_step, self.update_freq):
                self._write_interval()
            if self.histogram_freq and _crossed(
                previous_step, self.global_step, self.histogram_freq
            ):
                self._write_sample_statistics()

    def on_epoch_end(self, epoch, logs=None):
        validation = {
            name.removeprefix("val_"): value
            for name, value in (logs or {}).items()
            if name.startswith("val_")
        }
        if validation and self._is_writer:
            self._write("validation", validation)

    def on_train_end(self, logs=None):
        if not self._is_writer:
            return
        # The steps since the last write, so that no overflow goes unreported.
        if self.global_step > self._interval_start_step:
            self._write_interval()
        for writer in self._writers.values():
            writer.flush()

    def _went_wrong(self, previous_logs: dict[str, Any]) -> bool:
        """Whether this step was skipped for a bad batch or at the scale's floor, or the
        loss turned non-finite."""
        logs, optimizer = self._last_logs, self.model.optimizer
        if "loss" in logs and not math.isfinite(float(logs["loss"])):
            if math.isfinite(float(previous_logs.get("loss", 0.0))):
                return True
        skipped = logs.get(tags.SKIPPED_STEPS, 0.0) > previous_logs.get(tags.SKIPPED_STEPS, 0.0)
        if not skipped or not isinstance(optimizer, LossScaleOptimizer):
            return False
        bad_batch = logs.get(tags.BAD_BATCHES, 0.0) > previous_logs.get(tags.BAD_BATCHES, 0.0)
        return bad_batch or logs.get(tags.LOSS_SCALE, math.inf) <= optimizer.min_scale

    def _diagnose(self) -> None:
        """Runs `diagnose_nonfinite` on this step's batch: a log line and a text event."""
        step = self.global_step
        if self._last_diagnosis is not None and step - self._last_diagnosis < self.diagnosis_every:
            return
        self._last_diagnosis = step
        data = self.diagnosis_data
        batch = tuple(data(step) if callable(data) else data)
        line = describe_for_log(step, diagnose_nonfinite(self.model, *batch[:2]))
        _LOGGER.warning("%s", line)
        with self._writer("train").as_default(step=step):
            tf.summary.text(tags.NONFINITE_DIAGNOSIS, line)

    def _start_interval(self) -> None:
        self._interval_start_step = self.global_step
        self._timed_seconds = 0.0
        self._timed_steps = 0
        for device in self._memory_devices:
            tf.config.experimental.reset_memory_stats(device)

    def _write_interval(self) -> None:
        scalars = dict(self._last_logs)
        if self._timed_steps:
            step_time = self._timed_seconds / self._timed_steps
            scalars[tags.STEP_TIME] = step_time
            if self.examples_per_step:
                scalars[tags.EXAMPLES_PER_SECOND] = self.examples_per_step / step_time
        for device in self._memory_devices:
            peak = tf.config.experimental.get_memory_info(device)["peak"]
            scalars[tags.PEAK_MEMORY + device] = peak / 2**20
        if self._float8:
            for path, statistics in float8_statistics(self.model).items():
                for name, value in statistics.scalars().items():
                    scalars[tags.float8_tag(path, name)] = value
        interval = (self._skipped_steps, self.global_step - self._interval_start_step)
        skipped = self._write("train", scalars, interval)
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            skipped = int(skipped)
            # Bad batches are skipped too, but are no overflow (the guards report them).
            bad = int(float(self._last_logs.get(tags.BAD_BATCHES, self._bad_batches)))
            overflows = skipped - self._skipped_steps - (bad - self._bad_batches)
            if overflows > 0:
                self._report_overflow(optimizer, overflows)
            self._skipped_steps, self._bad_batches = skipped, bad
        self._start_interval()

    def _optimizer_scalars(self, present: Collection[str]) -> dict[str, tf.Tensor]:
        """The optimizer's scalars not among the logged ones, read in a writing function's graph.

        Our optimizer's train steps log its state (`LossScaleOptimizer.
        step_logs`), exact for each step; it is read here only where a train
        step did not log it (a custom training loop), when the interval is
        written.
        """
        optimizer = self.model.optimizer
        scalars = {"learning_rate": optimizer.learning_rate}
        if isinstance(optimizer, LossScaleOptimizer):
            readers = {
                tags.LOSS_SCALE: lambda: optimizer.loss_scale,
                tags.SKIPPED_STEPS: lambda: tf.cast(optimizer.skipped_steps, tf.float32),
                tags.GRADIENT_NORM: lambda: optimizer.gradient_norm,
            }
            scalars.update({tag: read() for tag, read in readers.items() if tag not in present})
        return scalars

    def _report_overflow(self, optimizer: LossScaleOptimizer, skipped: int) -> None:
        """Logs and writes which variables had non-finite gradients in the interval."""
        counts = optimizer.nonfinite_counts()
        new = {
            path: count - self._nonfinite_counts.get(path, 0)
            for path, count in counts.items()
            if count > self._nonfinite_counts.get(path, 0)
        }
        self._nonfinite_counts = counts
        layers = sorted({_layer_of(path) for path in new})
        first, last = self._interval_start_step + 1, self.global_step
        _LOGGER.warning(
            "Step %d: %d of steps %d-%d skipped for non-finite gradients; layers: %s; "
            "variables: %s",
            last,
            skipped,
            first,
            last,
            ", ".join(layers),
            ", ".join(sorted(new)),
        )
        report = [
            f"**Step {last}**: {skipped} of steps {first}-{last} skipped for non-finite "
            f"gradients, in layers {', '.join(layers)}.",
            "",
            "| layer | variable | non-finite steps in the interval | in total |",
            "|---|---|---|---|",
            *(
                f"| {_layer_of(path)} | {path} | {count} | {counts[path]} |"
                for path, count in sorted(new.items())
            ),
        ]
        # Eagerly: the set of tags changes from one event to the next.
        with self._writer("train").as_default(step=self.global_step):
            tf.summary.text(tags.NONFINITE_TEXT, "\n".join(report))
            for path in new:
                tf.summary.scalar(tags.NONFINITE + path, counts[path])

    def _write_sample_statistics(self) -> None:
        """Writes activation and gradient magnitudes on `histogram_data`."""
        activations, gradients = self._sample_pass(*self.histogram_data)
        with self._writer("train").as_default(step=self.global_step):
            for kind, values in ((tags.ACTIVATION, activations), (tags.GRADIENT, gradients)):
                for name, value in values.items():
                    _write_magnitudes(kind, name, value)

    def _activations_and_gradients(
        self, x: Any, y: Any
    ) -> tuple[dict[str, tf.Tensor], dict[str, tf.Tensor]]:
        """The top-level layers' outputs and the scaled loss's gradients on a batch, by name.

        Traced (`_sample_pass`): Keras' float8 layers take no gradient eagerly.
        """
        model = self.model
        # A float8 scale's or amax history's "gradient" is its new value.
        trainable = [
            variable for variable in model.trainable_variables if not is_float8_state(variable)
        ]
        with tf.GradientTape() as tape:
            if self._probe is None:
                prediction, activations = model(x, training=False), {}
            else:
                outputs = self._probe(x, training=False)
                prediction, activations = outputs["prediction"], outputs["activations"]
            loss = model.compute_loss(x=x, y=y, y_pred=prediction, training=False)
            scaled_loss = model.optimizer.scale_loss(loss)
        gradients = {
            variable.path: gradient
            for variable, gradient in zip(trainable, tape.gradient(scaled_loss, trainable))
            if gradient is not None
        }
        return activations, gradients

    def _writer(self, name: str) -> tf.summary.SummaryWriter:
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(os.path.join(self.log_dir, name))
        return self._writers[name]

    def _write(
        self,
        writer_name: str,
        scalars: dict[str, Any],
        interval: tuple[int, int] | None = None,
    ) -> tf.Tensor | None:
        """Writes `scalars` in one call of a function traced once per set of tags.

        With `interval` (`(skipped steps before it, its steps)`) the function
        also reads and writes the optimizer's scalars (`_optimizer_scalars`),
        and returns its skipped steps (None for an optimizer without loss
        scaling). Reading each variable eagerly and writing through the
        `tf.function` made a write take 1.22 ms instead of 0.46 (measured).
        """
        # The optimizer too: the function reads the variables it was traced with.
        optimizer_id = None if interval is None else id(self.model.optimizer)
        key = (writer_name, tuple(scalars), optimizer_id)
        if key not in self._scalar_writers:
            self._scalar_writers[key] = _scalar_writer(
                self._writer(writer_name),
                key[1],
                None if interval is None else self._optimizer_scalars,
            )
        # One argument: each costs the call about 40 us of Python.
        arguments = [self.global_step, *(interval or (0, 0)), *map(float, scalars.values())]
        return self._scalar_writers[key](tf.constant(np.array(arguments, np.float64)))


def _check_count(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}. Received: {name}={value!r}")


def _scalar_writer(
    writer: tf.summary.SummaryWriter,
    names: tuple[str, ...],
    read_scalars: Callable[[Collection[str]], dict[str, tf.Tensor]] | None,
) -> Callable[[tf.Tensor], tf.Tensor | None]:
    """A function writing scalars `names` at a step, and what it reads.

    Its one argument is `[step, skipped steps before the interval, steps in
    it, *values]`, `values[i]` the value of `names[i]`.

    It calls `read_scalars(names)` in its graph for the scalars not among
    `names`, writes those too, and, given skipped steps (logged or read), the
    interval's overflow rate; it returns the skipped steps, if any.
    """

    @tf.function(input_signature=[tf.TensorSpec([3 + len(names)], tf.float64)])
    def write(arguments: tf.Tensor) -> tf.Tensor | None:
        step = tf.cast(arguments[0], tf.int64)
        interval = arguments[1:3]
        values = tf.cast(arguments[3:], tf.float32)
        scalars = {name: values[index] for index, name in enumerate(names)}
        if read_scalars:
            scalars.update(read_scalars(names))
        skipped = scalars.get(tags.SKIPPED_STEPS) if read_scalars else None
        if skipped is not None:
            before, steps = tf.unstack(tf.cast(interval, tf.float32))
            scalars[tags.OVERFLOW_RATE] = (skipped - before) / steps
        with writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(name, value)
        return skipped

    # Its concrete function: calling the `tf.function` itself costs twice as
    # much, in the Python that matches arguments to traces.
    return write.get_concrete_function()


def _crossed(previous_step: int, step: int, every: int) -> bool:
    """Whether a multiple of `every` lies in (previous_step, step].

    A batch can run several steps (`steps_per_execution`), so the step may
    jump over the multiple itself.
    """
    return step // every > previous_step // every


def _is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this task writes: the chief, or worker 0 of a cluster without one."""
    resolver = strategy.cluster_resolver
    if resolver is None or resolver.task_type in (None, "chief"):
        return True
    if resolver.task_type != "worker" or resolver.task_id != 0:
        return False
    return "chief" not in resolver.cluster_spec().as_dict()


def _memory_tracking_devices() -> list[str]:
    devices = []
    for device in tf.config.list_logical_devices():
        name = device.name.removeprefix("/device:")
        try:
            tf.config.experimental.get_memory_info(name)
        except ValueError:
            continue  # This device does not track its memory.
        devices.append(name)
    return devices


def _activation_probe(model: keras.Model) -> keras.Model | None:
    """A model returning the prediction and each top-level layer's output.

    None for a subclassed model, whose layers' outputs are not in a graph.
    """
    if not getattr(model, "inputs", None):
        return None
    activations = {
        layer.name: layer.output
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
        and isinstance(layer.output, keras.KerasTensor)
    }
    # `inputs`, `outputs`: a Sequential model has no `input`, `output`.
    return keras.Model(
        _single_or_list(model.inputs),
        {"prediction": _single_or_list(model.outputs), "activations": activations},
    )


def _single_or_list(tensors: list[keras.KerasTensor]) -> keras.KerasTensor | list:
    return tensors[0] if len(tensors) == 1 else tensors


def _write_magnitudes(kind: str, name: str, value: Any) -> None:
    """Writes where |value| falls against the float16 range."""
    magnitude = tf.abs(tf.reshape(tf.cast(tf.convert_to_tensor(value), tf.float32), [-1]))
    # NaN compares false, so `not <= max` counts it as overflowed.
    above = ~(magnitude <= FLOAT16_MAX)
    below = (magnitude > 0) & (magnitude < FLOAT16_MIN_NORMAL)
    tf.summary.scalar(kind + tags.ABOVE_FLOAT16_MAX + name, _fraction(above))
    tf.summary.scalar(kind + tags.BELOW_FLOAT16_NORMAL + name, _fraction(below))
    loggable = tf.boolean_mask(magnitude, (magnitude > 0) & tf.math.is_finite(magnitude))
    tf.summary.histogram(kind + tags.LOG2_MAGNITUDE + name, tf.math.log(loggable) / np.log(2.0))


def _fraction(mask: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.cast(mask, tf.float32))


def _layer_of(variable_path: str) -> str:
    return variable_path.rpartition("/")[0] or variable_path
