"""Train-step time of `mpt_keras.LossScaleOptimizer` against Keras' stock one.

    python -m benchmarks.loss_scale_overhead [--rounds=10 --steps_per_round=20]

Both variants train the reference Transformer LM in `mixed_float16` from the
same initial weights on the same batches, with the same inner optimizer. They
are measured in one process, interleaved round by round (alternating which goes
first) so that machine drift cancels; each round times `steps_per_round` calls
of the compiled train function, synchronised at the end of the round. The
result is the median step time per variant, their ratio (ours / stock), and
the median of the per-round ratios: each round's two measurements are adjacent
in time, so that figure is the one least disturbed by other load on the
machine.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

from mpt_keras import models
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.policies import global_policy

_ROUNDS = flags.DEFINE_integer("rounds", 30, "Interleaved measurement rounds.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps_per_round", 10, "Train steps per round.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup_steps", 20, "Untimed steps per variant.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 32, "Sequences per batch.", lower_bound=1)
_LENGTH = flags.DEFINE_integer("sequence_length", 64, "Tokens per sequence.", lower_bound=2)
_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer blocks.", lower_bound=1)
_WIDTH = flags.DEFINE_integer("d_model", 64, "Transformer width.", lower_bound=8)
_OUTPUT = flags.DEFINE_string("output", None, "Write the result as JSON here too.")

VARIANTS: dict[str, Callable[[keras.Optimizer], keras.Optimizer]] = {
    "stock": keras.optimizers.LossScaleOptimizer,
    "mpt_keras": LossScaleOptimizer,
}


def measure(
    rounds: int,
    steps_per_round: int,
    warmup_steps: int,
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
    runners = {}
    with global_policy("mixed_float16"):
        for name, wrap in VARIANTS.items():
            keras.utils.set_random_seed(0)
            model = models.build_transformer_lm(
                256, sequence_length, num_layers=num_layers, d_model=d_model, num_heads=4
            )
            model.compile(
                optimizer=wrap(keras.optimizers.AdamW(1e-3)),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=False,
            )
            runners[name] = _Runner(model, iter(dataset))
            runners[name].run(warmup_steps)

    step_times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for round_index in range(rounds):
        for name in order if round_index % 2 == 0 else reversed(order):
            step_times[name].append(runners[name].run(steps_per_round) / steps_per_round)
    medians = {name: statistics.median(times) for name, times in step_times.items()}
    return {
        "benchmark": "loss_scale_overhead",
        "model": {
            "name": "transformer_lm",
            "num_layers": num_layers,
            "d_model": d_model,
            "sequence_length": sequence_length,
            "batch_size": batch_size,
        },
        "policy": "mixed_float16",
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "median_step_seconds": medians,
        "step_seconds": step_times,
        "ratio_mpt_keras_over_stock": medians["mpt_keras"] / medians["stock"],
        "paired_ratio_median": statistics.median(
            ours / stock
            for ours, stock in zip(step_times["mpt_keras"], step_times["stock"], strict=True)
        ),
        "devices": [device.name for device in tf.config.list_logical_devices()],
    }


class _Runner:
    """Calls a compiled train function; `run` returns the seconds it took."""

    def __init__(self, model: keras.Model, iterator):
        self._model = model
        self._iterator = iterator
        model.make_train_function()

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            logs = self._model.train_function(self._iterator)
        float(logs["loss"])  # Waits for the last step.
        return time.perf_counter() - start


def main(argv: Sequence[str]) -> None:
    del argv
    result = measure(
        _ROUNDS.value,
        _STEPS.value,
        _WARMUP.value,
        _BATCH.value,
        _LENGTH.value,
        _LAYERS.value,
        _WIDTH.value,
    )
    medians = result["median_step_seconds"]
    print(f"{'variant':<10} {'median step (ms)':>17}")
    for name, seconds in medians.items():
        print(f"{name:<10} {seconds * 1e3:>17.2f}")
    print(f"ours / stock: {result['ratio_mpt_keras_over_stock']:.3f}")
    print(f"ours / stock, median of per-round ratios: {result['paired_ratio_median']:.3f}")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as file:
            json.dump(result, file, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
