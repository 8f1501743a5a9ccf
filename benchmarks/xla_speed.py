"""Train-step time with and without XLA, per precision, beside what `auto` picks.

    python -m benchmarks.xla_speed [--rounds=30 --steps_per_round=5]

For each reference model (the small Transformer LM and the 8x8 CNN) and each
precision (float32, mixed_bfloat16, mixed_float16), two copies of the model,
with the same initial weights and batches and `mpt_keras.LossScaleOptimizer`,
are compiled by `mpt_keras.xla.compile_model`: one with XLA per replica, one
without. All copies are measured in one process, interleaved round by round
(see `benchmarks.harness`); the two copies of a pair run next to each other.
Each round times `steps_per_round` calls of the train function. Per pair the
result is the ratio XLA / no XLA (below 1: XLA is faster) and what
`resolve_jit_compile("auto", ...)` chooses on this machine, with whether that
is the faster of the two by the median of the per-round ratios.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

from benchmarks import harness
from mpt_keras import models, xla
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.policies import global_policy

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
MODELS = ("transformer_lm", "cnn")
VARIANTS = ("no_xla", "xla")

_IMAGE_BATCH = flags.DEFINE_integer("image_batch_size", 64, "CNN images per batch.", lower_bound=1)
_PRECISIONS = flags.DEFINE_multi_enum("precision", PRECISIONS, PRECISIONS, "Precisions to measure.")
_MODELS = flags.DEFINE_multi_enum("model", MODELS, MODELS, "Reference models to measure.")

_VOCAB_SIZE = 256
_IMAGE_SHAPE = (8, 8, 1)
_NUM_CLASSES = 10


def measure(
    rounds: int,
    steps_per_round: int,
    warmup_steps: int,
    batch_size: int,
    image_batch_size: int,
    sequence_length: int,
    num_layers: int,
    d_model: int,
    model_names: Sequence[str] = MODELS,
    precisions: Sequence[str] = PRECISIONS,
) -> dict[str, Any]:
    """Measures each (model, precision) with and without XLA; returns the JSON-ready result."""
    builders = {
        "transformer_lm": lambda: models.build_transformer_lm(
            _VOCAB_SIZE, sequence_length, num_layers=num_layers, d_model=d_model, num_heads=4
        ),
        "cnn": lambda: models.build_cnn(_IMAGE_SHAPE, _NUM_CLASSES),
    }
    batches = {
        "transformer_lm": harness.token_batches(batch_size, sequence_length),
        "cnn": _image_batches(image_batch_size),
    }
    runners = {}
    for model_name in model_names:
        for precision in precisions:
            for variant in VARIANTS:
                with global_policy(precision):
                    keras.utils.set_random_seed(0)
                    model = builders[model_name]()
                    xla.compile_model(
                        model,
                        optimizer=LossScaleOptimizer(keras.optimizers.AdamW(1e-3)),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        jit_compile=variant == "xla",
                    )
                    runner = harness.train_function_runner(model, iter(batches[model_name]))
                    runner(warmup_steps)
                runners[_key(model_name, precision, variant)] = runner
    step_seconds = harness.interleave(runners, rounds, steps_per_round)

    strategy = tf.distribute.get_strategy()
    results: dict[str, dict[str, Any]] = {}
    for model_name in model_names:
        results[model_name] = {}
        for precision in precisions:
            pair = {
                variant: step_seconds[_key(model_name, precision, variant)] for variant in VARIANTS
            }
            comparison = harness.compare(pair, "xla", "no_xla")
            auto, reason = xla.resolve_jit_compile("auto", strategy, precision)
            results[model_name][precision] = {
                **comparison,
                "auto_jit_compile": auto,
                "auto_reason": reason,
                "auto_picks_faster": auto == (comparison["paired_ratio_median"] < 1),
            }
    dimensions = {
        "transformer_lm": {
            "num_layers": num_layers,
            "d_model": d_model,
            "sequence_length": sequence_length,
            "batch_size": batch_size,
        },
        "cnn": {"input_shape": list(_IMAGE_SHAPE), "batch_size": image_batch_size},
    }
    return {
        "benchmark": "xla_speed",
        "models": {name: dimensions[name] for name in model_names},
        "optimizer": "mpt_keras.LossScaleOptimizer(AdamW(1e-3))",
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "results": results,
        "devices": harness.devices(),
    }


def _key(model_name: str, precision: str, variant: str) -> str:
    return f"{model_name}/{precision}/{variant}"


def _image_batches(batch_size: int) -> tf.data.Dataset:
    """An endless stream of (image, label) batches of random values."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch_size * 8, *_IMAGE_SHAPE)).astype(np.float32)
    labels = rng.integers(0, _NUM_CLASSES, size=batch_size * 8, dtype=np.int32)
    return (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .prefetch(tf.data.AUTOTUNE)
    )


def main(argv: Sequence[str]) -> None:
    del argv
    result = measure(
        harness.ROUNDS.value,
        harness.STEPS_PER_ROUND.value,
        harness.WARMUP_STEPS.value,
        harness.BATCH_SIZE.value,
        _IMAGE_BATCH.value,
        harness.SEQUENCE_LENGTH.value,
        harness.NUM_LAYERS.value,
        harness.D_MODEL.value,
        _MODELS.value,
        _PRECISIONS.value,
    )
    lines = [
        f"{'model':<15} {'precision':<15} {'no XLA (ms)':>11} {'XLA (ms)':>9} "
        f"{'XLA/no':>7} {'paired':>7}  auto"
    ]
    for model_name, by_precision in result["results"].items():
        for precision, row in by_precision.items():
            medians = row["median_step_seconds"]
            choice = "XLA" if row["auto_jit_compile"] else "no XLA"
            verdict = "faster" if row["auto_picks_faster"] else "SLOWER"
            lines.append(
                f"{model_name:<15} {precision:<15} {medians['no_xla'] * 1e3:>11.2f} "
                f"{medians['xla'] * 1e3:>9.2f} {row['ratio']:>7.2f} "
                f"{row['paired_ratio_median']:>7.2f}  {choice} ({verdict})"
            )
    harness.report(result, lines, harness.OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
