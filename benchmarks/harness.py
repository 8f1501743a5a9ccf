"""What the benchmarks share: flags, the token stream, interleaved timing, output.

Every benchmark measures its variants in ONE process, interleaved round by
round (alternating which goes first) so that machine drift cancels, and
reports per variant the median step time over the rounds, and for a pair of
variants the ratio of the medians and the median of the per-round ratios: a
round's two measurements are adjacent in time, so that figure is the one least
disturbed by other load on the machine.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import flags

from mpt_keras import models
from mpt_keras.training import TRAINING_LOSS

ROUNDS = flags.DEFINE_integer("rounds", 20, "Interleaved measurement rounds.", lower_bound=1)
STEPS_PER_ROUND = flags.DEFINE_integer(
    "steps_per_round", 10, "Train steps per round.", lower_bound=1
)
WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", 10, "Untimed steps per variant before the rounds.", lower_bound=1
)
BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "LM sequences per batch.", lower_bound=1)
SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", 64, "LM tokens per sequence.", lower_bound=2
)
NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "LM Transformer blocks.", lower_bound=1)
D_MODEL = flags.DEFINE_integer("d_model", 64, "LM Transformer width.", lower_bound=8)
OUTPUT = flags.DEFINE_string("output", None, "Also write the result as JSON here.")


def token_batches(batch_size: int, sequence_length: int) -> tf.data.Dataset:
    """An endless stream of (tokens, next tokens) batches of random bytes."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(batch_size * 8, sequence_length + 1), dtype=np.int32)
    return (
        tf.data.Dataset.from_tensor_slices((tokens[:, :-1], tokens[:, 1:]))
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )


def compiled_transformer_lm(
    optimizer: keras.Optimizer, sequence_length: int, num_layers: int, d_model: int
) -> keras.Model:
    """The reference Transformer LM from seed 0, compiled without XLA."""
    keras.utils.set_random_seed(0)
    model = models.build_transformer_lm(
        256, sequence_length, num_layers=num_layers, d_model=d_model, num_heads=4
    )
    model.compile(optimizer=optimizer, loss=TRAINING_LOSS, jit_compile=False)
    return model


def transformer_lm_description(
    num_layers: int, d_model: int, sequence_length: int, batch_size: int
) -> dict[str, Any]:
    """How `compiled_transformer_lm` was sized, for a result's JSON."""
    return {
        "name": "transformer_lm",
        "num_layers": num_layers,
        "d_model": d_model,
        "sequence_length": sequence_length,
        "batch_size": batch_size,
    }


def train_function_runner(model: keras.Model, iterator: Any) -> Callable[[int], float]:
    """Calls the compiled train function; returns the seconds `steps` calls took."""
    model.make_train_function()

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            logs = model.train_function(iterator)
        float(logs["loss"])  # Waits for the last step.
        return time.perf_counter() - start

    return run


def interleave(
    runners: Mapping[str, Callable[[int], float]], rounds: int, steps_per_round: int
) -> dict[str, list[float]]:
    """Times the variants round by round; returns per-round seconds per step.

    Args:
        runners: Per variant, a function that runs that many steps and returns
            the seconds they took (synchronised at its end).
        rounds: Measurement rounds.
        steps_per_round: Steps per variant and round.
    """
    names = list(runners)
    step_seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else reversed(names):
            step_seconds[name].append(runners[name](steps_per_round) / steps_per_round)
    return step_seconds


def compare(step_seconds: Mapping[str, list[float]], numerator: str, denominator: str) -> dict:
    """Medians per variant, their ratio, and the median of the per-round ratios."""
    medians = {name: statistics.median(times) for name, times in step_seconds.items()}
    return {
        "median_step_seconds": medians,
        "step_seconds": dict(step_seconds),
        "ratio": medians[numerator] / medians[denominator],
        "paired_ratio_median": statistics.median(
            a / b for a, b in zip(step_seconds[numerator], step_seconds[denominator], strict=True)
        ),
    }


def comparison_lines(result: Mapping[str, Any], label: str) -> list[str]:
    """A table of the variants' median steps and the `compare` ratios, as lines."""
    medians = result["median_step_seconds"]
    width = max(len("variant"), *map(len, medians))
    lines = [f"{'variant':<{width}} {'median step (ms)':>17}"]
    lines += [f"{name:<{width}} {seconds * 1e3:>17.2f}" for name, seconds in medians.items()]
    return lines + [
        f"{label}: {result['ratio']:.3f}",
        f"{label}, median of the per-round ratios: {result['paired_ratio_median']:.3f}",
    ]


def report(result: Mapping[str, Any], lines: list[str], output: str | None) -> None:
    """Prints `lines` and writes `result` as JSON to `output` if given."""
    print("\n".join(lines))
    if output:
        with open(output, "w") as file:
            json.dump(result, file, indent=2)
    sys.stdout.flush()


def devices() -> list[str]:
    """The logical devices the measurement ran on."""
    return [device.name for device in tf.config.list_logical_devices()]
