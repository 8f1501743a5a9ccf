"""A run's config resolved in layers (defaults, a file, `--config_override`, flags); a bad
value or missing file is named by the layer that set it."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from mpt_keras.config.train_config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.files import parse_json_object


def resolve_config(
    path: str | os.PathLike,
    config_override: str | None = None,
    **flag_values: Any,
) -> TrainConfig:
    """Resolves a run's config: the file, then `config_override` (JSON object text), then
    `flag_values` (top-level keys; `None` leaves one be). `UserInputError` names the file,
    `--config_override` or `--<flag>`.
    """
    config = TrainConfig.from_json(path)
    check_files(config, os.fspath(path))
    layers = []
    if config_override:
        layers.append(
            ("--config_override", parse_json_object(config_override, "--config_override"))
        )
    layers += [
        (f"--{name}", {name: value}) for name, value in flag_values.items() if value is not None
    ]
    set_by = {}  # The file's own files checked here; a later layer's, below.
    for source, overrides in layers:
        before = _files(config)
        config = config.merged(overrides, source=source)
        set_by.update(
            {name: source for name, value in _files(config).items() if value != before[name]}
        )
    for name in _files(config):
        if name in set_by:
            check_files(config, set_by[name], keys=(name,))
    return config


def check_files(
    config: TrainConfig, source: str = "config", keys: Collection[str] | None = None
) -> None:
    """Checks the files a config names exist (`keys`: `manifest`, `model.file`, default both);
    `UserInputError` names `source` (what set them), the key and the path."""
    for name, path in _files(config).items():
        if (keys is None or name in keys) and path is not None and not os.path.isfile(path):
            raise UserInputError(f"{source}: key '{name}': no such file {path!r}")


def _files(config: TrainConfig) -> dict[str, str | None]:
    return {"manifest": config.manifest, "model.file": config.model.file}
