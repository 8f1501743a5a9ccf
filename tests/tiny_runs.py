"""A tiny `run_training` config (and one whose float16 layer overflows until AutoPromote moves
it), the bundled configs' models shrunk, and a callback that crashes a run at a step, for
tests."""

from __future__ import annotations

import json
import os
from typing import Any

from mpt_keras.config import TrainConfig
from mpt_keras.keras_bridge.callbacks import GlobalStepCallback


def tiny_config(tfds_dir: str, **changes: Any) -> TrainConfig:
    """The digits MLP for 6 steps: checkpoints and validation every 3, telemetry every 2; no
    SavedModel (its trace is a tenth of such a run; tests/test_runs_training.py exports one)."""
    values = {
        "precision": "float32",
        "saved_model": False,
        "steps": 6,
        "checkpoint_every": 3,
        "eval_every": 3,
        "log_every": 2,
        "data": {"name": "mpt_digits", "data_dir": tfds_dir, "batch_size": 16, "eval_examples": 64},
        "model": {"name": "mlp", "options": {"hidden_units": [16]}},
        "optimizer": {
            "name": "adam",
            "learning_rate": 0.01,
            "schedule": "cosine",
            "warmup_steps": 2,
        },
    }
    return TrainConfig.from_dict(values).merged(changes)


def manifest_file(path: str | os.PathLike, default: str, *rules: dict[str, Any]) -> str:
    """Writes a version-1 manifest of `default` and `rules` to `path` (a config's `manifest` is
    a path); returns the path as a string."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"version": 1, "default": default, "rules": list(rules)}, file)
    return str(path)


def overflowing_config(
    tfds_dir: str | None, directory: str | os.PathLike, **changes: Any
) -> TrainConfig:
    """`tiny_config` for 12 steps with AutoPromote, dense_0 in float16 under a loss scale pinned
    at 2**24 (its floor): every step overflows until AutoPromote moves dense_0 to bfloat16,
    after 4 steps. Its manifest is written to `directory`."""
    manifest = manifest_file(
        os.path.join(directory, "manifest.json"),
        "mixed_bfloat16",
        {"match": {"path": "dense_0"}, "policy": "mixed_float16"},
    )
    pinned = {"initial_scale": 2.0**24, "min_scale": 2.0**24, "max_scale": 2.0**24}
    return tiny_config(
        tfds_dir, manifest=manifest, steps=12, auto_promote=True, loss_scale=pinned, **changes
    )


def small_model(config_name: str) -> dict[str, Any]:
    """The `--config_override` sections that shrink a bundled config's own model to about the
    smallest it goes, for tests whose point is not the model's size."""
    return {
        "digits_cnn.json": {"model": {"options": {"filters": [4], "dense_units": 16}}},
        "digits_mlp.json": {"model": {"options": {"hidden_units": [16]}}},
        "python_source_transformer.json": {
            "model": {"options": {"num_layers": 1, "d_model": 16, "num_heads": 2}},
            "data": {"sequence_length": 8},
        },
    }[config_name]


class Crash(Exception):
    """What `CrashAtStep` raises: a run that dies mid-interval."""


class CrashAtStep(GlobalStepCallback):
    """Raises `Crash` at the end of the given global step."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self.global_step == self.step:
            raise Crash
