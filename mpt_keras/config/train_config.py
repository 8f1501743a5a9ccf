"""TrainConfig: all that decides what a run computes, read strictly from JSON;
`model_dir/config.json` is `to_json()`, read back as the same config.

    config = TrainConfig.from_json("configs/digits_cnn.json").merged({"steps": 20})
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from mpt_keras.backend.names import STRATEGIES
from mpt_keras.config import key_checks as check
from mpt_keras.config import schema
from mpt_keras.config.component_sections import ComponentConfig, DataConfig, ModelConfig
from mpt_keras.config.names import JIT_COMPILE, MAX_SEED, MODULE_NAME
from mpt_keras.config.optimizer_sections import DivergenceConfig, OptimizerConfig
from mpt_keras.errors import UserInputError
from mpt_keras.files import read_json_object, write_text_atomic
from mpt_keras.precision.names import PRECISIONS
from mpt_keras.scaling.settings import LossScaleSettings


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what a run computes.

    Attributes:
        steps: Total train steps (a resumed run stops here).
        checkpoint_every: Also the length of one Keras "epoch" of `fit`.
        auto_promote: Promote layers overflowing at the loss-scale floor (`AutoPromote`).
        saved_model: Export `saved_model/` at the end (TensorFlow only; it costs a trace).
        imports: Modules imported before components resolve (custom layers register).
        loss, metrics: `None`: the reference models' own, or a `model.file`'s.
        loss_scale: Of float16 layers; other runs pin the scale at 1.
    """

    precision: str = "float32"
    manifest: str | None = None
    seed: int = 0
    steps: int = 200
    checkpoint_every: int = 100
    eval_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 10
    strategy: str = "auto"
    virtual_cpus: int = 0
    tpu: str | None = None
    jit_compile: str = "auto"
    auto_promote: bool = False
    deterministic: bool = False
    saved_model: bool = True
    imports: tuple[str, ...] = ()
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    loss: ComponentConfig | None = None
    metrics: tuple[ComponentConfig, ...] | None = None
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    loss_scale: LossScaleSettings = dataclasses.field(default_factory=LossScaleSettings)
    divergence: DivergenceConfig = dataclasses.field(default_factory=DivergenceConfig)

    def __post_init__(self):
        check.choice("precision", self.precision, PRECISIONS)
        check.choice("strategy", self.strategy, STRATEGIES)
        check.choice("jit_compile", self.jit_compile, JIT_COMPILE)
        check.require(
            isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED,
            "seed",
            f"an integer in [0, {MAX_SEED}]",
            self.seed,
        )
        check.number("steps", self.steps, minimum=1, integer=True)
        check.number("checkpoint_every", self.checkpoint_every, minimum=1, integer=True)
        check.require(
            self.eval_every >= 1 and self.eval_every % self.checkpoint_every == 0,
            "eval_every",
            f"a positive multiple of checkpoint_every ({self.checkpoint_every})",
            self.eval_every,
        )
        for name in ("keep_checkpoints", "log_every"):
            check.number(name, getattr(self, name), minimum=1, integer=True)
        check.number("virtual_cpus", self.virtual_cpus, minimum=0, integer=True)
        check.require(
            self.loss is not None or self.model.factory is None,
            "loss",
            "a loss (a Keras name or a factory) when the model comes from model.factory",
            None,
        )
        for index, module in enumerate(self.imports):
            check.require(
                MODULE_NAME.fullmatch(module) is not None,
                f"imports[{index}]",
                "a dotted module name such as 'my_project.layers'",
                module,
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> TrainConfig:
        """Builds a config from a JSON-like mapping; missing keys keep defaults.
        `UserInputError` names `source` (a file, a flag), the key and what is allowed."""
        try:
            return schema.build(cls, values)
        except UserInputError as error:
            raise UserInputError(f"{source}: {error}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        """Reads a config file; see `from_dict`."""
        return cls.from_dict(read_json_object(path), source=os.fspath(path))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (`from_dict` inverts it)."""
        return schema.to_plain(self)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The config as indented JSON text, also written to `path` (through a rename) when
        given: the file `from_json(path)` reads."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            write_text_atomic(path, text)
        return text

    def merged(self, overrides: Mapping[str, Any], source: str = "override") -> TrainConfig:
        """This config with `overrides` (shaped like the file) merged in (`schema.deep_merge`);
        refusals as `from_dict`'s."""
        if not isinstance(overrides, Mapping):
            raise UserInputError(
                f"{source}: expected a JSON object, received {type(overrides).__name__}"
            )
        return TrainConfig.from_dict(schema.deep_merge(self.to_dict(), overrides), source=source)
