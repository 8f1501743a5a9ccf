"""mpt-validate: checks a mixed-precision candidate against a float32 baseline.

    mpt-validate --config=configs/digits_cnn.json --precision=mixed_float16 \\
        --output=/tmp/validation/report.json

Compares the candidate (`--precision` or `--manifest`, exactly one) with float32
on the same data: `--steps` training steps from the same weights and batch
order, then the outputs of every layer on the validation split, from the
weights float32 reached (see `mpt_keras.runs.validation`). Writes `--output` (the
report JSON), `<stem>.txt` (the report as a table), `<stem>.png` (the two loss
curves) and the loss curves to TensorBoard under `--tensorboard_dir` (default
`<stem>_logs`).

Exit status: 0 when every threshold holds; 1 when one fails, after one line on
stderr per failed check (`mpt-validate: check failed: <check>: <value> (allowed
<= <threshold>)`); 2 for a usage error (a bad flag, config or manifest). The
report table is printed on stdout in every case, so a CI job can gate on the
status and keep the log.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

import mpt_keras
from mpt_keras import config as config_lib
from mpt_keras.precision.names import PRECISIONS
from mpt_keras.validation import thresholds
from trainers import backend_flag, cli, field_flags
from trainers.field_flags import FieldFlag

CHECK_FAILED = 1

_CONFIG = flags.DEFINE_string("config", None, "Run config file (JSON).", required=True)
_PRECISION = flags.DEFINE_enum(
    "precision",
    None,
    PRECISIONS,
    "Candidate precision; exactly one of --precision and --manifest.",
)
_MANIFEST = flags.DEFINE_string(
    "manifest", None, "Candidate precision manifest (JSON); exactly one of it and --precision."
)
_OUTPUT = flags.DEFINE_string(
    "output", None, "Report JSON; <stem>.txt and <stem>.png are written beside it.", required=True
)
# Not --log_dir: absl.logging defines that flag (the directory of its log files).
_TENSORBOARD_DIR = flags.DEFINE_string(
    "tensorboard_dir", None, "TensorBoard directory of the loss curves; default <output stem>_logs."
)
_STEPS = flags.DEFINE_integer(
    "steps", thresholds.DEFAULT_STEPS, "Training-parity steps of each model.", lower_bound=1
)
_CONFIG_OVERRIDE = flags.DEFINE_string(
    "config_override", None, "JSON object merged into the config file's."
)
_THRESHOLDS = field_flags.define(
    thresholds.Thresholds,
    {
        "output_rtol": FieldFlag(
            "Largest relative error ||cand - base|| / ||base|| of any model output.",
            lower_bound=0,
        ),
        "min_top1_agreement": FieldFlag(
            "Smallest fraction of predictions whose argmax agrees with float32.",
            lower_bound=0,
            upper_bound=1,
        ),
        "max_kl": FieldFlag("Largest mean KL divergence of the output softmax.", lower_bound=0),
        "max_metric_delta": FieldFlag(
            "Largest drop of the final validation accuracy against float32.", lower_bound=0
        ),
        "max_loss_gap": FieldFlag(
            "Largest relative gap of the final training loss against float32.", lower_bound=0
        ),
        "max_skipped_fraction": FieldFlag(
            "Largest fraction of the candidate's steps skipped for non-finite gradients.",
            lower_bound=0,
        ),
    },
    __name__,
)


_BACKEND = backend_flag.define(__name__)


def main(argv: Sequence[str]) -> None:
    del argv  # Checked by cli.run.
    if (_PRECISION.value is None) == (_MANIFEST.value is None):
        raise mpt_keras.UserInputError(
            "the candidate: received "
            f"{'both --precision and --manifest' if _PRECISION.value else 'neither'}. "
            "Allowed: exactly one of --precision and --manifest"
        )
    config = config_lib.resolve_config(_CONFIG.value, _CONFIG_OVERRIDE.value)
    limits = thresholds.Thresholds(**field_flags.values(_THRESHOLDS))
    cli.import_tensorflow()
    backend_flag.check("mpt-validate", _BACKEND.value)
    report = mpt_keras.run_validation(
        config,
        _PRECISION.value or _MANIFEST.value,
        _OUTPUT.value,
        limits,
        steps=_STEPS.value,
        log_dir=_TENSORBOARD_DIR.value,
    )
    print(report.table(), end="")
    for check in report.failed_checks():
        print(f"mpt-validate: check failed: {check.describe()}", file=sys.stderr)
    if not report.passed:
        sys.exit(CHECK_FAILED)


def run() -> None:
    """Console-script entry point of `mpt-validate`."""
    cli.run(
        main,
        program="mpt-validate",
        help_groups={
            "The candidate and its run": (
                "config",
                "config_override",
                "precision",
                "manifest",
                "steps",
                "output",
                "tensorboard_dir",
                "backend",
            ),
            "Thresholds": (
                "output_rtol",
                "min_top1_agreement",
                "max_kl",
                "max_metric_delta",
                "max_loss_gap",
                "max_skipped_fraction",
            ),
        },
    )


if __name__ == "__main__":
    run()
