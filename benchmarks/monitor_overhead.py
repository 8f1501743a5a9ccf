"""Train-step time of `model.fit` with `mpt_keras.MixedPrecisionMonitor` against without.

    python -m benchmarks.monitor_overhead [--rounds=20 --steps_per_round=50]

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
import tempfile
import time
from collections.abc import Sequence

import keras
import tensorflow as tf
from absl import app, flags

from benchmarks import common_flags, harness
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.monitor import MixedPrecisionMonitor
from mpt_keras.policies import global_policy

DEFAULT_UPDATE_FREQ = inspect.signature(MixedPrecisionMonitor).parameters["update_freq"].default

_UPDATE_FREQ = flags.DEFINE_integer(
    "update_freq", DEFAULT_UPDATE_FREQ, "The monitor's update_freq.", lower_bound=1
)

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
    dataset = harness.token_batches(batch_size, sequence_length)
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
                model = harness.compiled_transformer_lm(
                    LossScaleOptimizer(keras.optimizers.AdamW(1e-3)),
                    sequence_length,
                    num_layers,
                    d_model,
                )
                runners[name] = _Runner(model, dataset, callbacks[name]).run
                runners[name](warmup_steps)
            step_seconds = harness.interleave(runners, rounds, steps_per_round)
    return {
        "benchmark": "monitor_overhead",
        "model": harness.transformer_lm_description(
            num_layers, d_model, sequence_length, batch_size
        ),
        "policy": "mixed_float16",
        "update_freq": update_freq,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        **harness.compare(step_seconds, "with_monitor", "without_monitor"),
        "devices": harness.devices(),
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
        common_flags.ROUNDS.value,
        common_flags.STEPS_PER_ROUND.value,
        common_flags.WARMUP_STEPS.value,
        _UPDATE_FREQ.value,
        common_flags.BATCH_SIZE.value,
        common_flags.SEQUENCE_LENGTH.value,
        common_flags.NUM_LAYERS.value,
        common_flags.D_MODEL.value,
    )
    lines = harness.comparison_lines(result, "with / without")
    harness.report(result, lines, common_flags.OUTPUT.value)


if __name__ == "__main__":
    app.run(main)
