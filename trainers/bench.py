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

On Keras' JAX backend (`--backend=jax`, the only one on a machine without TensorFlow) the
same suite runs the steps as JAX's `fit` does, with XLA on unless `--xla` says otherwise;
memory peaks and `--profile_steps` are TensorFlow's: docs/backends.md.
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
from trainers import backend_flag, cli, field_flags
from trainers.field_flags import FieldFlag

# The suite's flags take their defaults from it, which imports Keras (and TensorFlow on its
# backend): quietly, before the flags are read, so a backend that cannot load is said here.
try:
    cli.import_tensorflow()
except UserInputError as error:
    print(f"mpt-bench: error: {error}", file=sys.stderr)
    sys.exit(2)
from benchmarks import result_files, suite, suite_settings  # noqa: E402
from mpt_keras.backend import current  # noqa: E402

_CONFIG = flags.DEFINE_string(
    "config",
    None,
    "Run config (JSON) whose model, data and loss to measure, instead of the reference models.",
)
_CONFIG_OVERRIDE = flags.DEFINE_string(
    "config_override", None, "JSON object merged into --config's (needs --config)."
)
_SETTINGS = field_flags.define(
    suite_settings.Settings,
    {
        "models": FieldFlag(
            f"Reference models, of {', '.join(suite_settings.MODELS)}.",
            default=suite_settings.MODELS,
        ),
        "precisions": FieldFlag(f"Precisions, of {', '.join(POLICY_NAMES)}."),
        "xla": FieldFlag(
            f"XLA settings, of {', '.join(suite_settings.XLA_SETTINGS)}; on Keras' JAX backend "
            "the default is on alone (off runs the step op by op)."
        ),
        "stacks": FieldFlag(
            "ours (manifest + mpt_keras.LossScaleOptimizer + monitor) and/or stock (Keras alone)."
        ),
        "rounds": FieldFlag("Interleaved measurement rounds.", lower_bound=1),
        "steps_per_round": FieldFlag("Train steps per round.", lower_bound=1),
        "warmup_steps": FieldFlag("Untimed steps per variant.", lower_bound=1),
        "memory_steps": FieldFlag("Train steps of the memory reading.", lower_bound=1),
        "batch_size": FieldFlag("Sequences per batch of the reference LM.", lower_bound=1),
        "sequence_length": FieldFlag("Tokens per sequence of the reference LM.", lower_bound=2),
        "num_layers": FieldFlag("Transformer blocks of the reference LM.", lower_bound=1),
        "d_model": FieldFlag("Width of the reference LM (a multiple of 4).", lower_bound=4),
        "image_batch_size": FieldFlag(
            "Images per batch of the reference CNN and MLP.", lower_bound=1
        ),
        "matmul_size": FieldFlag("Rows of the matmul peak's matrices.", lower_bound=1),
        "matmul_rounds": FieldFlag("Rounds of the matmul peak.", lower_bound=1),
        "float8": FieldFlag(
            "Also measure, next to each mixed_float16 and mixed_bfloat16 variant, its twin whose "
            "Dense and EinsumDense layers train in float8, labelled emulated where the hardware "
            "has no float8 matmul units (any CPU)."
        ),
        "profile_steps": FieldFlag(
            "Steps per XLA-off variant under the TensorFlow profiler, after the timed rounds; "
            "0 profiles nothing (and only 0 on Keras' JAX backend). Traces go to "
            "<output>/profile.",
            lower_bound=0,
        ),
    },
    __name__,
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


_BACKEND = backend_flag.define(__name__)
# On Keras' JAX backend `--xla=off` runs the step op by op in Python (`jit_compile=False`):
# measured only when asked.
_JAX_XLA = ("on",)


def main(argv: Sequence[str]) -> None:
    del argv  # Checked by cli.run.
    backend_flag.check("mpt-bench", _BACKEND.value)
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
    values = field_flags.values(_SETTINGS)
    if current.is_jax() and not flags.FLAGS["xla"].present:
        values["xla"] = _JAX_XLA
    if config:
        values["models"] = None  # The config's own model.
    settings = suite_settings.Settings(
        **values,
        config=config,
        config_name=pathlib.Path(_CONFIG.value).stem if config else "config",
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
                "backend",
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
