"""Train-step time of `model.fit` with `mpt_keras.MixedPrecisionMonitor` against without.

    python -m benchmarks.monitor_overhead [--rounds=10 --steps_per_round=50]

Both variants train the reference Transformer LM in `mixed_float16` with
`mpt_keras.LossScaleOptimizer` from the same initial weights on the same
batches; one fits with the monitor at its default `update_freq` (throughput
included), the other with no callback. They are measured in one process,
interleaved round by round (alternating which goes first) so that machine drift
cancels; each round is one `fit` of `steps_per_round` steps, timed whole, so it
includes the monitor's start and end of `fit` as well as its interval writes.
The result is the median step time per variant and their ratio (with / without),
and the median of the per-round ratios.
"""

from __future__ import annotations

import inspect
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

from mpt_keras import models
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.monitor import MixedPrecisionMonitor
from mpt_keras.policies import global_policy

DEFAULT_UPDATE_FREQ = inspect.signature(MixedPrecisionMonitor).parameters["update_freq"].default

_ROUNDS = flags.DEFINE_integer("rounds", 10, "Interleaved measurement rounds.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps_per_round", 50, "Train steps per round.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup_steps", 10, "Untimed steps per variant.", lower_bound=1)
_UPDATE_FREQ = flags.DEFINE_integer(
    "update_freq", DEFAULT_UPDATE_FREQ, "The monitor's update_freq.", lower_bound=1
)
_BATCH = flags.DEFINE_integer("batch_size", 32, "Sequences per batch.", lower_bound=1)
_LENGTH = flags.DEFINE_integer("sequence_length", 64, "Tokens per sequence.", lower_bound=2)
_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer blocks.", lower_bound=1)
_WIDTH = flags.DEFINE_integer("d_model", 64, "Transformer width.", lower_bound=8)
_OUTPUT = flags.DEFINE_string("output", None, "Write the result as JSON here too.")

VARIANTS = ("without_monitor", "with_monitor")


def measure(
    rounds: int,
    steps_per_round: int,
    warmup_steps: int,
    update_freq: int,
    batch_size: int,
    sequence_length: int,
    num_layers: int,
    d_model: int,
) -> dict:
    """Measures both variants, interleaved; returns the JSON-ready result."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(batch_size * 8, sequence_length + 1), dtype=np.int32)
    dataset = (
        tf.data.Dataset.from_tensor_slices((tokens[:, :-1], tokens[:, 1:]))
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )
    with tempfile.TemporaryDirectory() as log_dir:
        callbacks = {
            "without_monitor": [],
            "with_monitor": [
                MixedPrecisionMonitor(
                    log_dir, update_freq=update_freq, examples_per_step=batch_size
                )
            ],
        }
        with global_policy("mixed_float16"):
            runners = {}
            for name in VARIANTS:
                keras.utils.set_random_seed(0)
                model = models.build_transformer_lm(
                    256, sequence_length, num_layers=num_layers, d_model=d_model, num_heads=4
                )
                model.compile(
                    optimizer=LossScaleOptimizer(keras.optimizers.AdamW(1e-3)),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    jit_compile=False,
                )
                runners[name] = _Runner(model, dataset, callbacks[name])
                runners[name].run(warmup_steps)

            step_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for round_index in range(rounds):
                for name in VARIANTS if round_index % 2 == 0 else reversed(VARIANTS):
                    step_times[name].append(runners[name].run(steps_per_round) / steps_per_round)
    medians = {name: statistics.median(times) for name, times in step_times.items()}
    return {
        "benchmark": "monitor_overhead",
        "model": {
            "name": "transformer_lm",
            "num_layers": num_layers,
            "d_model": d_model,
            "sequence_length": sequence_length,
            "batch_size": batch_size,
        },
        "policy": "mixed_float16",
        "update_freq": update_freq,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "median_step_seconds": medians,
        "step_seconds": step_times,
        "ratio_with_over_without": medians["with_monitor"] / medians["without_monitor"],
        # Rounds run back to back, so a load spike on the shared machine
        # tends to hit both halves of a pair.
        "median_paired_ratio": statistics.median(
            with_ / without
            for with_, without in zip(step_times["with_monitor"], step_times["without_monitor"])
        ),
        "devices": [device.name for device in tf.config.list_logical_devices()],
    }


class _Runner:
    """Fits a model for a number of steps; `run` returns the seconds it took."""

    def __init__(
        self,
        model: keras.Model,
        dataset: tf.data.Dataset,
        callbacks: list[keras.callbacks.Callback],
    ):
        self._model = model
        self._dataset = dataset
        self._callbacks = callbacks

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        # fit returns once the History callback has read the last step's logs.
        self._model.fit(
            self._dataset,
            steps_per_epoch=steps,
            epochs=1,
            callbacks=self._callbacks,
            shuffle=False,  # The dataset is what it is; fit would warn.
            verbose=0,
        )
        return time.perf_counter() - start


def main(argv: Sequence[str]) -> None:
    del argv
    result = measure(
        _ROUNDS.value,
        _STEPS.value,
        _WARMUP.value,
        _UPDATE_FREQ.value,
        _BATCH.value,
        _LENGTH.value,
        _LAYERS.value,
        _WIDTH.value,
    )
    medians = result["median_step_seconds"]
    print(f"{'variant':<16} {'median step (ms)':>17}")
    for name, seconds in medians.items():
        print(f"{name:<16} {seconds * 1e3:>17.2f}")
    print(f"with / without: {result['ratio_with_over_without']:.3f}")
    print(f"median of the per-round ratios: {result['median_paired_ratio']:.3f}")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as file:
            json.dump(result, file, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
