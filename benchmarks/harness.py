"""What the benchmarks share: the reference models and their data, interleaved timing, output.

Variants are timed in ONE process, round by round (alternating which goes
first), so machine drift cancels. A pair's ratio is given as the ratio of the
medians and the median of the per-round ratios: a round's measurements are
adjacent in time, so the latter is the least disturbed by other load.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from benchmarks import result_files
from mpt_keras import models
from mpt_keras.precision.hardware import PROC_CPUINFO, probe_hardware

VOCAB_SIZE = 256
IMAGE_SHAPE = (8, 8, 1)
NUM_CLASSES = 10


def token_batches(batch_size: int, sequence_length: int) -> tf.data.Dataset:
    """Endless (tokens, next tokens) batches of random bytes."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(batch_size * 8, sequence_length + 1), dtype=np.int32)
    return (
        tf.data.Dataset.from_tensor_slices((tokens[:, :-1], tokens[:, 1:]))
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )


def image_batches(batch_size: int) -> tf.data.Dataset:
    """Endless (8x8 image, label) batches of random values."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch_size * 8, *IMAGE_SHAPE)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=batch_size * 8, dtype=np.int32)
    return (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )


def build_transformer_lm(sequence_length: int, num_layers: int, d_model: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    return models.build_transformer_lm(
        VOCAB_SIZE, sequence_length, num_layers=num_layers, d_model=d_model, num_heads=4
    )


def build_cnn() -> keras.Model:
    keras.utils.set_random_seed(0)
    return models.build_cnn(IMAGE_SHAPE, NUM_CLASSES)


def build_mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    return models.build_mlp(IMAGE_SHAPE, NUM_CLASSES)


def reference_model(name: str, sequence_length: int, num_layers: int, d_model: int) -> keras.Model:
    """The reference model `name`, from seed 0, in the global policy; the sizes are the LM's."""
    if name == "transformer_lm":
        return build_transformer_lm(sequence_length, num_layers, d_model)
    return build_cnn() if name == "cnn" else build_mlp()


def reference_batches(name: str, batch_size: int, sequence_length: int) -> tf.data.Dataset:
    """Endless batches for the reference model `name`."""
    if name == "transformer_lm":
        return token_batches(batch_size, sequence_length)
    return image_batches(batch_size)


def transformer_lm_description(
    num_layers: int, d_model: int, sequence_length: int, batch_size: int
) -> dict[str, Any]:
    """The Transformer LM's sizes, for a result's JSON."""
    return {
        "name": "transformer_lm",
        "num_layers": num_layers,
        "d_model": d_model,
        "sequence_length": sequence_length,
        "batch_size": batch_size,
    }


class FitLoop:
    """Runs train steps as `model.fit` does, with its callbacks, resumable round by round.

    Each call runs more steps of one endless epoch, the callbacks' batch hooks
    around each, through a `CallbackList` made as `fit` makes it (so hooks are
    dispatched as in `fit`). Unlike a `fit` per round, the start and end of
    training are paid once (here and in `end`), as in a real run.
    """

    def __init__(self, model: keras.Model, iterator: Any, callbacks: Sequence[Any] = ()):
        self._model = model
        self._iterator = iterator
        model.make_train_function()
        self._callbacks = keras.callbacks.CallbackList(
            list(callbacks), add_history=True, model=model, verbose=0, epochs=1, steps=None
        )
        self._callbacks.on_train_begin()
        self._callbacks.on_epoch_begin(0)
        self._step = 0

    def __call__(self, steps: int) -> float:
        """Runs `steps` steps; returns their seconds, the last one finished."""
        start = time.perf_counter()
        for _ in range(steps):
            self._callbacks.on_train_batch_begin(self._step)
            logs = self._model.train_function(self._iterator)
            self._callbacks.on_train_batch_end(self._step, logs)
            self._step += 1
        float(logs["loss"])  # Waits for the last step.
        return time.perf_counter() - start

    def end(self) -> None:
        """Ends training for the callbacks (a monitor writes its last interval)."""
        self._callbacks.on_epoch_end(0, {})
        self._callbacks.on_train_end()


def interleave(
    runners: Mapping[str, Callable[[int], float]], rounds: int, steps_per_round: int
) -> dict[str, list[float]]:
    """Times the variants round by round; returns per-round seconds per step.

    Args:
        runners: Per variant, runs that many steps and returns the seconds
            they took (synchronised at its end).
    """
    names = list(runners)
    step_seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            step_seconds[name].append(runners[name](steps_per_round) / steps_per_round)
    return step_seconds


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """The ratio of the medians, and the median of the per-round ratios."""
    return {
        "ratio": statistics.median(numerator) / statistics.median(denominator),
        "paired_ratio_median": statistics.median(
            a / b for a, b in zip(numerator, denominator, strict=True)
        ),
    }


def report(result: Mapping[str, Any], lines: list[str], output: str | None) -> None:
    """Prints `lines` and writes `result` as JSON to `output` if given."""
    print("\n".join(lines))
    if output:
        with open(output, "w") as file:
            json.dump(result, file, indent=2)
    sys.stdout.flush()


def devices() -> list[str]:
    return [device.name for device in tf.config.list_logical_devices()]


def machine() -> dict[str, Any]:
    """The machine and software measured on, for a result's JSON."""
    cpu_flags = probe_hardware(PROC_CPUINFO).cpu_flags  # The machine's, whatever `auto` reads.
    return {
        "cpu": result_files.cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": sorted(result_files.LOW_PRECISION_CPU_FLAGS.intersection(cpu_flags)),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"),
        "devices": devices(),
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
