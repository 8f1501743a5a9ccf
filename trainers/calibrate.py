"""mpt-calibrate: measures a run's model in float32 and writes a precision manifest.

    mpt-calibrate --config=configs/python_source_transformer.json --steps=4 \
        --output=/tmp/transformer_manifest.json
    mpt-train --config=configs/python_source_transformer.json --model_dir=/tmp/run \
        --manifest=/tmp/transformer_manifest.json

The model is built as `mpt-train` builds it from the config and fed the run's
first `--steps` train batches; each layer gets float16, bfloat16 or float32
with the reason and its numbers. With `--float8`, each Dense and EinsumDense
whose figures allow it, and whose GEMM is measured faster in float8 on this
device (`--float8_speed=measure`; never on a CPU, whose float8 is emulated;
`ignore`: by the figures alone), gets a float8 rule; the statistics hold
every one's figures and reason either way. The model, data and loss are the config's,
a reference model or the user's own (`model.factory`, `model.file`). The
statistics go to `<output stem>.stats.json` (or `--stats_output`); a table of
the decisions is printed, with a last line naming the first non-finite
gradient if a batch had one (a non-finite layer output is an error naming
the layer).
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

import mpt_keras
from mpt_keras import config as config_lib
from trainers import backend_flag, cli

_CONFIG = flags.DEFINE_string("config", None, "Run config file (JSON).", required=True)
_OUTPUT = flags.DEFINE_string(
    "output", None, "Where the precision manifest (JSON) is written.", required=True
)
_STATS_OUTPUT = flags.DEFINE_string(
    "stats_output", None, "Where the statistics (JSON) go; default <output stem>.stats.json."
)
_STEPS = flags.DEFINE_integer("steps", 8, "Train batches to measure.", lower_bound=1)
_CONFIG_OVERRIDE = flags.DEFINE_string(
    "config_override", None, "JSON object merged into the config file's."
)
_FLOAT8 = flags.DEFINE_bool(
    "float8",
    False,
    "Give float8 rules to the Dense and EinsumDense layers whose amax and float8 shares allow "
    "it. Off by default: without float8 units float8 is emulated, and slower.",
)
_FLOAT8_SPEED = flags.DEFINE_enum(
    "float8_speed",
    "measure",
    ["measure", "ignore"],
    "With --float8: measure (float8 only where this device's float8 GEMMs of the layer's "
    "shape are measured faster; never on a CPU) or ignore (by the numbers alone, to calibrate "
    "for another device).",
)


_BACKEND = backend_flag.define(__name__)


def main(argv: Sequence[str]) -> None:
    del argv  # Checked by cli.run.
    config = config_lib.resolve_config(_CONFIG.value, _CONFIG_OVERRIDE.value)
    cli.import_tensorflow()
    backend_flag.check("mpt-calibrate", _BACKEND.value)
    result = mpt_keras.run_calibration(
        config,
        _OUTPUT.value,
        stats_output=_STATS_OUTPUT.value,
        steps=_STEPS.value,
        float8=_FLOAT8.value,
        float8_speed=_FLOAT8_SPEED.value,
    )
    print(result.table(), end="")


def run() -> None:
    """Console-script entry point of `mpt-calibrate`."""
    cli.run(
        main,
        program="mpt-calibrate",
        help_groups={
            "Calibration": (
                "config",
                "config_override",
                "steps",
                "float8",
                "float8_speed",
                "output",
                "stats_output",
                "backend",
            )
        },
    )


if __name__ == "__main__":
    run()
