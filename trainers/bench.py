"""mpt-bench: every precision, XLA setting and stack side by side, against the machine's limit.

    mpt-bench --output=bench_results
    mpt-bench --models=cnn --precisions=float32,mixed_bfloat16 --xla=off --rounds=5

Measures in one process, interleaved: the matmul peak per dtype, then each
variant (model x precision x XLA x stack: ours or stock Keras) of the
reference models (see `benchmarks.suite`). Prints the table on stdout;
`--output` is a directory that gets `bench.json` and `bench.png`.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from trainers import cli

# The suite's flags take their defaults from it, which imports TensorFlow: quietly.
cli.import_tensorflow()
from benchmarks import suite  # noqa: E402

_DEFAULTS = suite.Settings()

_MODELS = flags.DEFINE_list(
    "models", list(suite.MODELS), f"Reference models, of {', '.join(suite.MODELS)}."
)
_PRECISIONS = flags.DEFINE_list(
    "precisions", list(suite.PRECISIONS), f"Precisions, of {', '.join(suite.PRECISIONS)}."
)
_XLA = flags.DEFINE_list(
    "xla", list(suite.XLA_SETTINGS), f"XLA settings, of {', '.join(suite.XLA_SETTINGS)}."
)
_STACKS = flags.DEFINE_list(
    "stacks",
    list(suite.STACKS),
    "ours (manifest + mpt_keras.LossScaleOptimizer + monitor) and/or stock (Keras alone).",
)
_ROUNDS = flags.DEFINE_integer(
    "rounds", _DEFAULTS.rounds, "Interleaved measurement rounds.", lower_bound=1
)
_STEPS_PER_ROUND = flags.DEFINE_integer(
    "steps_per_round", _DEFAULTS.steps_per_round, "Train steps per round.", lower_bound=1
)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", _DEFAULTS.warmup_steps, "Untimed steps per variant.", lower_bound=1
)
_MEMORY_STEPS = flags.DEFINE_integer(
    "memory_steps", _DEFAULTS.memory_steps, "Train steps of the memory reading.", lower_bound=1
)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", _DEFAULTS.batch_size, "LM sequences per batch.", lower_bound=1
)
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", _DEFAULTS.sequence_length, "LM tokens per sequence.", lower_bound=2
)
_NUM_LAYERS = flags.DEFINE_integer(
    "num_layers", _DEFAULTS.num_layers, "LM Transformer blocks.", lower_bound=1
)
_D_MODEL = flags.DEFINE_integer(
    "d_model", _DEFAULTS.d_model, "LM width (a multiple of 4).", lower_bound=4
)
_IMAGE_BATCH_SIZE = flags.DEFINE_integer(
    "image_batch_size", _DEFAULTS.image_batch_size, "CNN images per batch.", lower_bound=1
)
_MATMUL_SIZE = flags.DEFINE_integer(
    "matmul_size", _DEFAULTS.matmul_size, "Rows of the matmul peak's matrices.", lower_bound=1
)
_MATMUL_ROUNDS = flags.DEFINE_integer(
    "matmul_rounds", _DEFAULTS.matmul_rounds, "Rounds of the matmul peak.", lower_bound=1
)
_PROFILE_STEPS = flags.DEFINE_integer(
    "profile_steps",
    _DEFAULTS.profile_steps,
    "Steps per XLA-off variant under the TensorFlow profiler, after the timed rounds; "
    "0 profiles nothing. Traces go to <output>/profile.",
    lower_bound=0,
)
_OUTPUT = flags.DEFINE_string(
    "output", None, "Directory for bench.json and bench.png; default: the table only."
)


def main(argv: Sequence[str]) -> None:
    del argv  # Checked by cli.run.
    settings = suite.Settings(
        models=tuple(_MODELS.value),
        precisions=tuple(_PRECISIONS.value),
        xla=tuple(_XLA.value),
        stacks=tuple(_STACKS.value),
        rounds=_ROUNDS.value,
        steps_per_round=_STEPS_PER_ROUND.value,
        warmup_steps=_WARMUP_STEPS.value,
        memory_steps=_MEMORY_STEPS.value,
        batch_size=_BATCH_SIZE.value,
        sequence_length=_SEQUENCE_LENGTH.value,
        num_layers=_NUM_LAYERS.value,
        d_model=_D_MODEL.value,
        image_batch_size=_IMAGE_BATCH_SIZE.value,
        matmul_size=_MATMUL_SIZE.value,
        matmul_rounds=_MATMUL_ROUNDS.value,
        profile_steps=_PROFILE_STEPS.value,
    )
    suite.run(settings, _OUTPUT.value)


def run() -> None:
    """Console-script entry point of `mpt-bench`."""
    cli.run(main, program="mpt-bench")


if __name__ == "__main__":
    run()
