"""mpt-train: trains a Keras model with mixed-precision compute from a config.

    mpt-train --config=configs/digits_cnn.json --model_dir=/tmp/digits

Flags override the config file; `--config_override` takes a JSON object merged
into it (`'{"data": {"batch_size": 32}}'`). Rerunning on the same `model_dir`
resumes from its last checkpoint and stops at `--steps` in all. `--dry_run`
prints each layer's precision (and what decided it) and exits.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

import mpt_keras
from mpt_keras import config as config_lib
from mpt_keras.backend.names import GPU_TARGETS
from mpt_keras.precision.names import PRECISIONS
from trainers import backend_flag, cli, field_flags
from trainers.field_flags import FieldFlag

_CONFIG = flags.DEFINE_string("config", None, "Run config file (JSON).", required=True)
_MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Directory of checkpoints, logs and results.", required=True
)
# Top-level config keys, set in this order; a flag left out leaves the key to the file.
_CONFIG_FLAGS = field_flags.define(
    config_lib.TrainConfig,
    {
        "precision": FieldFlag("Global dtype policy; default: the config's.", choices=PRECISIONS),
        "manifest": FieldFlag("Precision manifest (JSON) to apply."),
        "strategy": FieldFlag(
            "tf.distribute strategy, or on JAX a Keras distribution; default: the config's.",
            choices=config_lib.STRATEGIES,
        ),
        "virtual_cpus": FieldFlag(
            "Split the CPU into N logical devices (for mirrored; data_parallel on JAX).",
            lower_bound=0,
        ),
        "tpu": FieldFlag("TPU address for --strategy=tpu (grpc://host:port or name)."),
        "auto_promote": FieldFlag(
            "Promote layers that keep overflowing at the loss-scale floor (float16 -> "
            "bfloat16 -> float32) mid-run; the promoted manifest goes to "
            "model_dir/promoted_manifest.json."
        ),
        "deterministic": FieldFlag(
            "Enable TensorFlow's op determinism, so two runs of the same config give "
            "identical weights (slower on GPUs; some ops then refuse to run)."
        ),
        "jit_compile": FieldFlag("XLA-compile the train step.", choices=config_lib.JIT_COMPILE),
        "steps": FieldFlag("Total train steps of the run.", lower_bound=1),
        "saved_model": FieldFlag(
            "Export model_dir/saved_model, for TF Serving, at the end (TensorFlow only; "
            "--nosaved_model skips the export's trace)."
        ),
    },
    __name__,
    unset=True,
)
_CONFIG_OVERRIDE = flags.DEFINE_string(
    "config_override", None, "JSON object merged into the config file's."
)
_CANARY_STEPS = flags.DEFINE_integer(
    "canary_steps",
    0,
    "First train this many steps on a small subset in the run's precision and in float32; "
    "stop if the run's precision diverges (0: no canary).",
    lower_bound=0,
)
_METRICS_PORT = flags.DEFINE_integer(
    "metrics_port",
    None,
    "Serve Prometheus metrics on http://HOST:PORT/metrics from the chief during the run "
    "(default: no endpoint).",
    lower_bound=1,
    upper_bound=65535,
)
_BACKEND = backend_flag.define(__name__)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print each layer's precision and exit without training."
)
_CENSUS_TARGET = flags.DEFINE_enum(
    "census_target",
    None,
    list(GPU_TARGETS),
    "With --dry_run on --backend=jax: the float8 census of the train step compiled for this "
    "GPU, here, with no GPU needed (JAX's CUDA plugin; docs/precision.md).",
)


_HELP_GROUPS = {
    "The run": (
        "config",
        "model_dir",
        "config_override",
        "steps",
        "saved_model",
        "dry_run",
        "census_target",
        "metrics_port",
    ),
    "Precision": ("precision", "manifest", "auto_promote", "canary_steps"),
    "Backend, distribution and XLA": (
        "backend",
        "strategy",
        "virtual_cpus",
        "tpu",
        "jit_compile",
        "deterministic",
    ),
}


def main(argv: Sequence[str]) -> None:
    del argv  # Checked by cli.run.
    flag_values = field_flags.values(_CONFIG_FLAGS)
    if flag_values["precision"] is not None and flag_values["manifest"] is not None:
        raise mpt_keras.UserInputError(
            "--precision and --manifest exclude each other: a manifest decides every "
            "layer's policy (its 'default' and rules). Allowed: one of them"
        )
    # Checked whole, with no TensorFlow: a bad flag or config answers at once.
    config = config_lib.resolve_config(_CONFIG.value, _CONFIG_OVERRIDE.value, **flag_values)
    census_target = _CENSUS_TARGET.value
    if census_target is not None and not _DRY_RUN.value:
        raise mpt_keras.UserInputError(
            f"--census_target={census_target} without --dry_run: the census compiles the step "
            "for that GPU and never runs it. Allowed: with --dry_run"
        )
    cli.import_tensorflow()
    backend_flag.check("mpt-train", _BACKEND.value)
    if census_target is not None:
        backend_flag.check("mpt-train --census_target", _BACKEND.value, served=("jax",))
    if _DRY_RUN.value:
        report = mpt_keras.plan_precision(config, census_target=census_target)
        print(report.format_table(), end="")
        return
    runtime = mpt_keras.Runtime(model_dir=_MODEL_DIR.value, metrics_port=_METRICS_PORT.value)
    if _CANARY_STEPS.value:
        mpt_keras.train_with_canary(config, runtime, _CANARY_STEPS.value)
    else:
        mpt_keras.run_training(config, runtime)


def run() -> None:
    """Console-script entry point of `mpt-train`."""
    cli.run(main, program="mpt-train", help_groups=_HELP_GROUPS)


if __name__ == "__main__":
    run()
