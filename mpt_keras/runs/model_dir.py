"""A run's `model_dir`: its file names, and the checks before a run claims it (a rerun
resumes, so it must hold the same run)."""

from __future__ import annotations

import os

from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.files import check_creatable_dir, check_writable_dir, write_text_atomic

CONFIG_FILE = "config.json"
PRECISION_REPORT_FILE = "precision_report.json"
METRICS_FILE = "metrics.json"
METRICS_CSV_FILE = "metrics.csv"
MODEL_FILE = "model.keras"
PROMOTED_MANIFEST_FILE = "promoted_manifest.json"
LOGS_SUBDIR = "logs"

# A rerun may change only how long and where it runs (the global batch stays), not what it
# computes: the checkpoint would not match, or would mean another run.
_RESUMABLE_CHANGES = frozenset(
    {
        "steps",
        "checkpoint_every",
        "eval_every",
        "keep_checkpoints",
        "log_every",
        "jit_compile",
        "strategy",
        "virtual_cpus",
        "tpu",
        "deterministic",
        "saved_model",
    }
)


def check_model_dir(model_dir: str, config: TrainConfig) -> None:
    """Refuses an unwritable `model_dir` or one holding another run; writes nothing."""
    check_creatable_dir(model_dir, what="model_dir")
    config_path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.exists(config_path):
        return
    previous = TrainConfig.from_json(config_path).to_dict()
    current = config.to_dict()
    changed = sorted(
        key for key in current if current[key] != previous[key] and key not in _RESUMABLE_CHANGES
    )
    if changed:
        raise UserInputError(
            f"model_dir {model_dir} holds a run whose '{changed[0]}' differs "
            f"({previous[changed[0]]!r} there, {current[changed[0]]!r} now): use a new "
            f"model_dir, or change only {', '.join(sorted(_RESUMABLE_CHANGES))} to resume"
        )


def prepare_model_dir(model_dir: str, config: TrainConfig, write_config: bool) -> None:
    """Creates `model_dir` (`files.check_writable_dir`) and writes the run's config."""
    check_writable_dir(model_dir, what="model_dir")
    if write_config:
        write_text_atomic(os.path.join(model_dir, CONFIG_FILE), config.to_json())
