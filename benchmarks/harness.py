"""What the benchmarks share: the reference models and their data, interleaved timing, output.

Variants are timed in ONE process, round by round (alternating which goes
first), so machine drift cancels. A pair's ratio is given as the ratio of the
medians and the median of the per-round ratios: a round's measurements are
adjacent in time, so the latter is the least disturbed by other load.
"""

from __future__ import annotations

import itertools
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

from benchmarks import result_files
from mpt_keras import compat, models
from mpt_keras.backend import current
from mpt_keras.compat import jax_trainer
from mpt_keras.precision.hardware import PROC_CPUINFO, probe_hardware

VOCAB_SIZE = 256
IMAGE_SHAPE = (8, 8, 1)
NUM_CLASSES = 10


def token_batches(batch_size: int, sequence_length: int) -> Any:
    """Endless (tokens, next tokens) batches of random bytes."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(batch_size * 8, sequence_length + 1), dtype=np.int32)
    return endless_batches(tokens[:, :-1], tokens[:, 1:], batch_size)


def image_batches(batch_size: int) -> Any:
    """Endless (8x8 image, label) batches of random values."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch_size * 8, *IMAGE_SHAPE)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=batch_size * 8, dtype=np.int32)
    return endless_batches(images, labels, batch_size)


def endless_batches(x: np.ndarray, y: np.ndarray, batch_size: int) -> Any:
    """`(x, y)` in full batches, repeated without end: a `tf.data.Dataset`, or on JAX an
    endless iterator of NumPy batches (each step's copied to the device as `fit` copies it)."""
    if current.is_jax():
        starts = range(0, len(x) - batch_size + 1, batch_size)
        return itertools.cycle([(x[i : i + batch_size], y[i : i + batch_size]) for i in starts])
    import tensorflow as tf

    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )


def step_iterator(batches: Any) -> Any:
    """The iterator a train step takes its batch from: a dataset's, or on JAX each batch put on
    the device first, as Keras' JAX `fit` does."""
    if not current.is_jax():
        return iter(batches)
    import jax

    return map(jax.device_put, iter(batches))


def input_spec(batches: Any) -> Any:
    """The inputs' spec of a batch of `batches`: a dataset's `tf.TensorSpec`s, or on JAX
    `jax.ShapeDtypeStruct`s of its first batch (nested as the inputs are)."""
    if not current.is_jax():
        return keras.utils.unpack_x_y_sample_weight(batches.element_spec)[0]
    import jax

    inputs = keras.utils.unpack_x_y_sample_weight(next(iter(batches)))[0]
    return keras.tree.map_structure(
        lambda array: jax.ShapeDtypeStruct(np.shape(array), array.dtype), inputs
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


def reference_batches(name: str, batch_size: int, sequence_length: int) -> Any:
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
    training are paid once (here and in `end`), as in a real run. On JAX the
    state stays on the device between steps, as in `fit`: `sync` puts it back in
    the variables before they are read.
    """

    def __init__(self, model: keras.Model, iterator: Any, callbacks: Sequence[Any] = ()):
        self._model = model
        self._iterator = iterator
        if current.is_jax():
            # As JAX's `fit` builds what is not (its step needs a built optimizer): from the
            # first batch's specs, which the first step then takes.
            first = next(iterator)
            compat.symbolic_build(model, first)
            self._iterator = itertools.chain([first], iterator)
        model.make_train_function()
        self._callbacks = keras.callbacks.CallbackList(
            list(callbacks), add_history=True, model=model, verbose=0, epochs=1, steps=None
        )
        self._callbacks.on_train_begin()
        self._callbacks.on_epoch_begin(0)
        self._step = 0
        self._state = None  # JAX's, between steps.

    def __call__(self, steps: int) -> float:
        """Runs `steps` steps; returns their seconds, the last one finished."""
        start = time.perf_counter()
        for _ in range(steps):
            self._callbacks.on_train_batch_begin(self._step)
            logs = self._train_step()
            self._callbacks.on_train_batch_end(self._step, logs)
            self._step += 1
        float(logs["loss"])  # Waits for the last step.
        return time.perf_counter() - start

    def _train_step(self) -> dict[str, Any]:
        if current.is_jax():
            logs, self._state = jax_trainer.fit_train_step(self._model, self._state, self._iterator)
            return logs
        return self._model.train_function(self._iterator)

    def sync(self) -> None:
        """Puts the trained state back in the model's variables (on JAX; on TensorFlow they
        hold it)."""
        if current.is_jax():
            self._model.jax_state_sync()

    def end(self) -> None:
        """Ends training for the callbacks (a monitor writes its last interval)."""
        self._callbacks.on_epoch_end(0, {})
        self._callbacks.on_train_end()
        self.sync()


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
    """The backend's devices, by name."""
    if current.is_jax():
        return result_files.jax_machine()["devices"]
    import tensorflow as tf

    return [device.name for device in tf.config.list_logical_devices()]


def machine() -> dict[str, Any]:
    """The machine and software measured on, for a result's JSON."""
    cpu_flags = probe_hardware(PROC_CPUINFO).cpu_flags  # The machine's, whatever `auto` reads.
    described = {
        "cpu": result_files.cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": sorted(result_files.LOW_PRECISION_CPU_FLAGS.intersection(cpu_flags)),
        "platform": platform.platform(),
    }
    if current.is_jax():
        described["jax"] = result_files.jax_machine()["jax"]
    else:
        import tensorflow as tf

        described["tensorflow"] = tf.__version__
        described["onednn"] = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")
    return {
        **described,
        "keras": keras.__version__,
        "devices": devices(),
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
