"""mpt-bench: every precision, XLA setting and stack side by side, against the machine's limit.

    mpt-bench --output=bench_results
    mpt-bench --models=cnn --precisions=float32,mixed_bfloat16 --xla=off --rounds=5
    mpt-bench --config=examples/configs/mobilenet_v2_digits.json --xla=off
    mpt-bench --models=transformer_lm --precisions=mixed_bfloat16 --float8

Measures in one process, interleaved: the matmul peak per dtype, then each
variant (model x precision x XLA x stack: ours or stock Keras) of the
reference models, or with `--config` of the run config's own model, data and
loss, built as `mpt-train` builds them (see `benchmarks.suite`). Prints the
table on stdout; `--output` is a directory that gets `bench.json` (with the
date, command and CPU flags of the run: `benchmarks.result_files`) and
`bench.png`.

With `--config` the variants are named after the file's stem
(`mobilenet_v2_digits/mixed_float16/xla_off/ours`) and train on the config's
batches (`data.batch_size`: change it in the file or with
`--config_override='{"data": {"batch_size": 64}}'`); `--models` and the
reference models' sizes (`--batch_size`, `--image_batch_size`,
`--sequence_length`, `--num_layers`, `--d_model`) are errors with it. The
config's precision, manifest, optimizer, metrics and XLA setting are not used:
the variants decide those. Memory and `--profile_steps` work for any model.

`--float8` adds, after each `mixed_float16` and `mixed_bfloat16` variant, its
twin with every Dense and EinsumDense layer in float8
(`transformer_lm/mixed_bfloat16+float8/xla_on/ours`), its speed over the twin
without float8, and `emulated` after its name unless float8 matmuls run on
float8 units (XLA on GPUs of compute capability 8.9 or newer): on a CPU
float8 is emulated, and slower (`benchmarks.float8_variants`).
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Sequence

from absl import flags

from mpt_keras import config as config_lib
from mpt_keras.errors import UserInputError
from mpt_keras.precision.names import POLICY_NAMES
from trainers import cli

# The suite's flags take their defaults from it, which imports TensorFlow: quietly.
cli.import_tensorflow()
from benchmarks import result_files, suite  # noqa: E402

_DEFAULTS = suite.Settings()

_CONFIG = flags.DEFINE_string(
    "config",
    None,
    "Run config (JSON) whose model, data and loss to measure, instead of the reference models.",
)
_CONFIG_OVERRIDE = flags.DEFINE_string(
    "config_override", None, "JSON object merged into --config's (needs --config)."
)
_MODELS = flags.DEFINE_list(
    "models", list(suite.MODELS), f"Reference models, of {', '.join(suite.MODELS)}."
)
_PRECISIONS = flags.DEFINE_list(
    "precisions", list(POLICY_NAMES), f"Precisions, of {', '.join(POLICY_NAMES)}."
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
    "batch_size", _DEFAULTS.batch_size, "Sequences per batch of the reference LM.", lower_bound=1
)
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length",
    _DEFAULTS.sequence_length,
    "Tokens per sequence of the reference LM.",
    lower_bound=2,
)
_NUM_LAYERS = flags.DEFINE_integer(
    "num_layers", _DEFAULTS.num_layers, "Transformer blocks of the reference LM.", lower_bound=1
)
_D_MODEL = flags.DEFINE_integer(
    "d_model", _DEFAULTS.d_model, "Width of the reference LM (a multiple of 4).", lower_bound=4
)
_IMAGE_BATCH_SIZE = flags.DEFINE_integer(
    "image_batch_size",
    _DEFAULTS.image_batch_size,
    "Images per batch of the reference CNN and MLP.",
    lower_bound=1,
)
_MATMUL_SIZE = flags.DEFINE_integer(
    "matmul_size", _DEFAULTS.matmul_size, "Rows of the matmul peak's matrices.", lower_bound=1
)
_MATMUL_ROUNDS = flags.DEFINE_integer(
    "matmul_rounds", _DEFAULTS.matmul_rounds, "Rounds of the matmul peak.", lower_bound=1
)
_FLOAT8 = flags.DEFINE_bool(
    "float8",
    _DEFAULTS.float8,
    "Also measure, next to each mixed_float16 and mixed_bfloat16 variant, its twin whose Dense "
    "and EinsumDense layers train in float8, labelled emulated where the hardware has no "
    "float8 matmul units (any CPU).",
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


# The reference models' flags, which a config decides for itself: where it does.
_CONFIG_DECIDES = {
    "models": "its model.name, model.factory or model.file",
    "batch_size": "data.batch_size",
    "image_batch_size": "data.batch_size",
    "sequence_length": "data.sequence_length or data.options",
    "num_layers": "model.options",
    "d_model": "model.options",
}


def main(argv: Sequence[str]) -> None:
    del argv  # Checked by cli.run.
    config = None
    if _CONFIG.value is not None:
        for name, key in _CONFIG_DECIDES.items():
            if flags.FLAGS[name].present:
                raise UserInputError(
                    f"--config and --{name}: received both. Allowed: one of them; with --config "
                    f"the config decides ({key}: edit it or use --config_override)"
                )
        config = config_lib.resolve_config(_CONFIG.value, _CONFIG_OVERRIDE.value)
    elif _CONFIG_OVERRIDE.value is not None:
        raise UserInputError("--config_override: received without --config. Allowed: with --config")
    settings = suite.Settings(
        models=None if config else tuple(_MODELS.value),
        config=config,
        config_name=pathlib.Path(_CONFIG.value).stem if config else "config",
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
        float8=_FLOAT8.value,
    )
    suite.run(settings, _OUTPUT.value)
    if _OUTPUT.value:
        # What ran the suite (the command, as typed) is the launcher's to record.
        result_files.stamp(
            os.path.join(_OUTPUT.value, suite.JSON_FILE), ["mpt-bench", *sys.argv[1:]]
        )


def run() -> None:
    """Console-script entry point of `mpt-bench`."""
    cli.run(
        main,
        program="mpt-bench",
        help_groups={
            "What is compared": (
                "config",
                "config_override",
                "models",
                "precisions",
                "xla",
                "stacks",
                "float8",
                "output",
            ),
            "How it is measured": (
                "rounds",
                "steps_per_round",
                "warmup_steps",
                "memory_steps",
                "profile_steps",
                "matmul_size",
                "matmul_rounds",
            ),
            "The models' sizes": (
                "batch_size",
                "image_batch_size",
                "sequence_length",
                "num_layers",
                "d_model",
            ),
        },
    )


if __name__ == "__main__":
    run()
