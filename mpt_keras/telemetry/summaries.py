"""The monitor's TensorBoard writers on TensorFlow (event_files.py: JAX's); its scalars
written in one traced call per tag set, reads included (eager reads took a write from 0.46 ms
to 1.22, measured).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras.telemetry import layout as tags
from mpt_keras.telemetry.optimizer_scalars import optimizer_scalars, overflow_rate

ScalarWriter = Callable[[tf.Tensor], "tf.Tensor | None"]


class SummaryWriters:
    """A summary writer per `log_dir` subdirectory (`""`, `train`, `validation`)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._writers: dict[str, tf.summary.SummaryWriter] = {}
        self._scalar_writers: dict[tuple[str, tuple[str, ...], int | None], ScalarWriter] = {}

    def writer(self, name: str) -> tf.summary.SummaryWriter:
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(os.path.join(self.log_dir, name))
        return self._writers[name]

    def write_scalars(
        self,
        name: str,
        step: int,
        scalars: dict[str, Any],
        optimizer: keras.optimizers.Optimizer | None = None,
        interval: tuple[int, int] | None = None,
    ) -> tf.Tensor | None:
        """Writes `scalars` at `step` under writer `name`.

        With `optimizer` and `interval` (`(skipped before it, its steps)`), also the
        optimizer's scalars the logs lack and the overflow rate; returns the skipped steps (None
        without loss scaling).
        """
        # The optimizer too: the function reads the variables traced with.
        key = (name, tuple(scalars), None if optimizer is None else id(optimizer))
        if key not in self._scalar_writers:
            read = None if optimizer is None else functools.partial(optimizer_scalars, optimizer)
            self._scalar_writers[key] = _scalar_writer(self.writer(name), key[1], read)
        # One argument: each costs the call about 40 us of Python.
        arguments = [step, *(interval or (0, 0)), *map(float, scalars.values())]
        return self._scalar_writers[key](tf.constant(np.array(arguments, np.float64)))

    def scalar(self, name: str, step: int, tag: str, value: Any) -> None:
        with self.writer(name).as_default(step=step):
            tf.summary.scalar(tag, value)

    def text(self, name: str, step: int, tag: str, text: str) -> None:
        with self.writer(name).as_default(step=step):
            tf.summary.text(tag, text)

    def write_layout(self, histograms: bool, float8: bool) -> None:
        tags.write_layout(self.writer(""), histograms=histograms, float8=float8)

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()


def _scalar_writer(
    writer: tf.summary.SummaryWriter,
    names: tuple[str, ...],
    read_scalars: Callable[[Collection[str]], dict[str, tf.Tensor]] | None,
) -> ScalarWriter:
    """A function of `[step, skipped before the interval, its steps, *values]` writing them
    and `read_scalars`' reads; returns the skipped steps, if any."""

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
            scalars[tags.OVERFLOW_RATE] = overflow_rate(skipped, before, steps)
        with writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(name, value)
        return skipped

    # Concrete: calling the `tf.function` costs twice as much, matching traces.
    return write.get_concrete_function()
