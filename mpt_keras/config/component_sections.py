"""Config sections for where a run's data, model, loss and metrics come from: each names one
source, a built-in `name`, a `factory` (`components`) or, for a model, a `.keras` `file`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mpt_keras.config import key_checks as check
from mpt_keras.config.names import DEFAULT_DATASET, DEFAULT_MODEL, MODEL_NAMES, SOURCE_KEYS


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which dataset feeds the run and how it is batched.

    Attributes:
        name: Embedded or TFDS (under `data_dir`); `mpt_digits` without `factory`.
        factory: Returns `(train, eval)` datasets of unbatched `(x, y[, w])`.
        features: A TFDS dataset's input and target, `{"x": "image", "y": "label"}`; `None`:
            the embedded datasets' shapes.
        eval_examples: Validation examples (0: the whole split).
        max_bad_batches: NaN/Inf train batches skipped; one more stops the run.
    """

    name: str | None = None
    factory: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    features: Mapping[str, Any] | None = None
    shuffle_buffer: int = 10_000
    data_dir: str | None = None
    train_split: str = "train"
    eval_split: str = "validation"
    batch_size: int = 64
    eval_batch_size: int = 256
    sequence_length: int = 64
    eval_examples: int = 0
    max_bad_batches: int = 10

    def __post_init__(self):
        if self.factory is None and self.name is None:
            object.__setattr__(self, "name", DEFAULT_DATASET)
        check.one_source(self, "data", ("name", "factory"))
        check.require(
            self.name is None or bool(self.name), "data.name", "a TFDS dataset name", self.name
        )
        check.require(
            not (self.options and self.name),
            "data.options",
            "empty unless data.factory is given (TFDS datasets take no options)",
            self.options,
        )
        check.require(
            self.features is None
            or (self.name is not None and check.is_feature_map(self.features)),
            "data.features",
            'null, or with data.name an object {"x": FEATURE or {INPUT: FEATURE, ...}, '
            '"y": FEATURE}',
            self.features,
        )
        for name, minimum in (
            ("shuffle_buffer", 1),
            ("batch_size", 1),
            ("eval_batch_size", 1),
            ("sequence_length", 2),
            ("eval_examples", 0),
            ("max_bad_batches", 0),
        ):
            check.number(f"data.{name}", getattr(self, name), minimum=minimum, integer=True)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where the model comes from: one of `name` (default `cnn`), `factory` and `file` (a
    `.keras` file: its weights start, its loss and metrics used unless the config names its
    own). `options`: the builder's or factory's keyword arguments.
    """

    name: str | None = None
    factory: str | None = None
    file: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.factory is None and self.file is None and self.name is None:
            object.__setattr__(self, "name", DEFAULT_MODEL)
        check.one_source(self, "model", SOURCE_KEYS)
        if self.name is not None:
            check.choice("model.name", self.name, MODEL_NAMES)
        if self.file is not None:
            check.require(
                self.file.endswith(".keras"), "model.file", "the path of a .keras file", self.file
            )
            check.require(not self.options, "model.options", "empty for model.file", self.options)


@dataclasses.dataclass(frozen=True)
class ComponentConfig:
    """Where a loss or metric comes from: one of `name` and `factory`. A bare JSON string is
    `{"name": ...}`; a `name` with `options` is a Keras class (snake_case resolves)."""

    name: str | None = None
    factory: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check.one_source(self, "", ("name", "factory"))
