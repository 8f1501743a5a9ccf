"""Train-step time of `mpt_keras.LossScaleOptimizer` against Keras' stock one.

    python -m benchmarks.loss_scale_overhead [--rounds=20 --steps_per_round=10]

Both variants train the reference Transformer LM in `mixed_float16` from the
same initial weights on the same batches, with the same inner optimizer; each
round times `steps_per_round` calls of the compiled train function,
synchronised at the end of the round (see `benchmarks.harness`).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
from absl import app

from benchmarks import common_flags, harness
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.policies import global_policy

VARIANTS = {
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
    dataset = harness.token_batches(batch_size, sequence_length)
    runners = {}
    with global_policy("mixed_float16"):
        for name, wrap in VARIANTS.items():
            model = harness.compiled_transformer_lm(
                wrap(keras.optimizers.AdamW(1e-3)), sequence_length, num_layers, d_model
            )
            runners[name] = harness.train_function_runner(model, iter(dataset))
            runners[name](warmup_steps)
    comparison = harness.compare(
        harness.interleave(runners, rounds, steps_per_round), "mpt_keras", "stock"
    )
    return {
        "benchmark": "loss_scale_overhead",
        "model": harness.transformer_lm_description(
            num_layers, d_model, sequence_length, batch_size
        ),
        "policy": "mixed_float16",
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        **comparison,
        "devices": harness.devices(),
    }


def main(argv: Sequence[str]) -> None:
    del argv
    result = measure(
        common_flags.ROUNDS.value,
        common_flags.STEPS_PER_ROUND.value,
        common_flags.WARMUP_STEPS.value,
        common_flags.BATCH_SIZE.value,
        common_flags.SEQUENCE_LENGTH.value,
        common_flags.NUM_LAYERS.value,
        common_flags.D_MODEL.value,
    )
    harness.report(
        result, harness.comparison_lines(result, "ours / stock"), common_flags.OUTPUT.value
    )


if __name__ == "__main__":
    app.run(main)
