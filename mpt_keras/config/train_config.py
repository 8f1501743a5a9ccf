"""Run configuration: frozen dataclasses parsed strictly from JSON.

A run is configured in layers, each strict: the dataclass defaults, then a config
file (`configs/*.json`), then `--config_override` (a JSON object merged key by key
into the file's), then the launcher's dedicated flags (`--precision`, `--steps`,
...). The resolved result is written to `model_dir/config.json`; reading that file
back gives the same `TrainConfig`.

An unknown key, a value of the wrong type or out of range is a `UserInputError`
naming the file, the dotted key and what is allowed. This module imports neither
TensorFlow nor Keras, so a bad config fails in well under a second.

Example:

    config = TrainConfig.from_json("configs/digits_cnn.json")
    config = config.merged({"steps": 20, "data": {"batch_size": 32}})

Why one module: the sections' dataclasses and the one strict parser that
builds them from JSON (`_build`, `_convert`) are read together; a section
moved out would import the parser back, and the config file's schema would
have no single page.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import typing
from collections.abc import Mapping
from typing import Any

from mpt_keras.config.components import FACTORY_SYNTAX
from mpt_keras.errors import UserInputError
from mpt_keras.files import parse_json_object, read_json_object
from mpt_keras.precision.names import PRECISIONS
from mpt_keras.scaling.settings import LossScaleSettings

STRATEGIES = ("auto", "one_device", "mirrored", "multi_worker", "tpu")
JIT_COMPILE = ("auto", "true", "false")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine")
DIVERGENCE_ACTIONS = ("rollback", "promote", "stop")
MODEL_NAMES = ("mlp", "cnn", "transformer_lm")
SOURCE_KEYS = ("name", "factory", "file")
DEFAULT_MODEL = "cnn"
DEFAULT_DATASET = "mpt_digits"
# NumPy's legacy seeding, which `keras.utils.set_random_seed` calls, takes 32 bits.
_MAX_SEED = 2**32 - 1
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which dataset feeds the run and how it is batched.

    The data comes from exactly one of `name` (a TFDS dataset) and `factory`
    (the user's code; see `mpt_keras.config.components`).

    Attributes:
        name: `mpt_digits`, `mpt_python_source` (both embedded, offline) or any
            TFDS dataset name prepared under `data_dir`; `mpt_digits` unless
            `factory` is given.
        factory: `"package.module:attribute"`, a callable returning `(train,
            eval)` `tf.data.Dataset`s of unbatched `(x, y)` or `(x, y,
            sample_weight)` elements.
        options: Keyword arguments of `factory`.
        features: For a TFDS dataset of any shape: which features are the
            model's input and target, `{"x": "image", "y": "label"}`
            (`"x"` may also map input names to features: `{"x": {"pixels":
            "image"}, "y": "label"}`). `None`: the embedded datasets' own
            shapes (an `image` and a `label`, or a `text`).
        shuffle_buffer: Elements in the shuffle buffer of `factory` and
            `features` data (the embedded shapes shuffle exactly, by index).
        data_dir: TFDS data directory; `None` uses TFDS' default
            (`~/tensorflow_datasets`).
        train_split: The split to train on.
        eval_split: The split to validate on.
        batch_size: Global batch size of a train step.
        eval_batch_size: Batch size for validation.
        sequence_length: Tokens per example for language models; unused for
            images.
        eval_examples: Validation examples to evaluate (0: the whole split).
        max_bad_batches: Train batches holding NaN or Inf values that the run
            skips (and reports); one more stops it.
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
        _require_one_source(self, "data", ("name", "factory"))
        _require(
            self.name is None or bool(self.name), "data.name", "a TFDS dataset name", self.name
        )
        _require(
            not (self.options and self.name),
            "data.options",
            "empty unless data.factory is given (TFDS datasets take no options)",
            self.options,
        )
        _require(
            self.features is None or (self.name is not None and _is_feature_map(self.features)),
            "data.features",
            'null, or with data.name an object {"x": FEATURE or {INPUT: FEATURE, ...}, '
            '"y": FEATURE}',
            self.features,
        )
        _require(
            self.shuffle_buffer >= 1, "data.shuffle_buffer", "an integer >= 1", self.shuffle_buffer
        )
        _require(self.batch_size >= 1, "data.batch_size", "an integer >= 1", self.batch_size)
        _require(
            self.eval_batch_size >= 1,
            "data.eval_batch_size",
            "an integer >= 1",
            self.eval_batch_size,
        )
        _require(
            self.sequence_length >= 2,
            "data.sequence_length",
            "an integer >= 2",
            self.sequence_length,
        )
        _require(
            self.eval_examples >= 0, "data.eval_examples", "an integer >= 0", self.eval_examples
        )
        _require(
            self.max_bad_batches >= 0,
            "data.max_bad_batches",
            "an integer >= 0",
            self.max_bad_batches,
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Where the model comes from: exactly one of `name`, `factory` and `file`.

    Attributes:
        name: A reference model, one of `MODEL_NAMES`; `cnn` unless `factory`
            or `file` is given.
        factory: `"package.module:attribute"`, a callable in the user's code
            that returns a Keras model (see `mpt_keras.config.components`).
        file: A `.keras` file: its architecture and weights are the starting
            point (loaded uncompiled; its compiled loss and metrics are used
            unless the config names its own).
        options: Keyword arguments of the reference model's builder or of
            `factory`, bound to its signature before anything runs.
    """

    name: str | None = None
    factory: str | None = None
    file: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.factory is None and self.file is None and self.name is None:
            object.__setattr__(self, "name", DEFAULT_MODEL)
        _require_one_source(self, "model", SOURCE_KEYS)
        if self.name is not None:
            _require_choice(self.name, "model.name", MODEL_NAMES)
        if self.file is not None:
            _require(
                self.file.endswith(".keras"), "model.file", "the path of a .keras file", self.file
            )
            _require(not self.options, "model.options", "empty for model.file", self.options)


@dataclasses.dataclass(frozen=True)
class ComponentConfig:
    """Where a loss or a metric comes from: exactly one of `name` and `factory`.

    In JSON a bare string is short for `{"name": ...}`: `"accuracy"`.

    Attributes:
        name: A Keras identifier: a loss or metric function or class name
            (`"sparse_categorical_crossentropy"`, `"SparseCategoricalCrossentropy"`,
            `"accuracy"`); with `options`, a class (snake_case names resolve
            to their class).
        factory: `"package.module:attribute"`, a callable in the user's code:
            a loss function itself, or a class or function returning one.
        options: Keyword arguments of the class or factory.
    """

    name: str | None = None
    factory: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _require_one_source(self, "", ("name", "factory"))


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The inner optimizer that the loss-scale optimizer wraps.

    Attributes:
        name: One of `OPTIMIZERS`.
        learning_rate: Peak learning rate.
        weight_decay: Decoupled weight decay (`adamw` only).
        schedule: `constant`, or `cosine` decay to zero over the run's steps.
        warmup_steps: Linear warm-up steps before the schedule.
        global_clipnorm: Clip the global gradient norm to this value; `None` off.
    """

    name: str = "adam"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    global_clipnorm: float | None = None

    def __post_init__(self):
        _require_choice(self.name, "optimizer.name", OPTIMIZERS)
        _require_choice(self.schedule, "optimizer.schedule", LR_SCHEDULES)
        _require(
            self.learning_rate > 0, "optimizer.learning_rate", "a number > 0", self.learning_rate
        )
        _require(
            self.weight_decay >= 0, "optimizer.weight_decay", "a number >= 0", self.weight_decay
        )
        _require(
            self.warmup_steps >= 0, "optimizer.warmup_steps", "an integer >= 0", self.warmup_steps
        )
        _require(
            self.global_clipnorm is None or self.global_clipnorm > 0,
            "optimizer.global_clipnorm",
            "null or a number > 0",
            self.global_clipnorm,
        )
        _require(
            self.weight_decay == 0 or self.name == "adamw",
            "optimizer.weight_decay",
            "0 unless optimizer.name is 'adamw'",
            self.weight_decay,
        )


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling of `mixed_float16` runs (see `LossScaleOptimizer`).

    Runs in other precisions pin the scale at 1: non-finite steps are still
    skipped and counted. Values are checked as `LossScaleSettings` when the
    config is read.

    Attributes:
        initial_scale: Starting scale.
        growth_factor: Factor (> 1) applied after `growth_interval` finite steps.
        backoff_factor: Factor in (0, 1) applied on an overflow.
        growth_interval: Consecutive finite steps between growths.
        hysteresis: Overflows since the last growth before the scale backs off.
        min_scale: The scale never goes below this.
        max_scale: The scale never goes above this.
    """

    initial_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self):
        try:
            LossScaleSettings(**dataclasses.asdict(self))
        except UserInputError as error:
            raise UserInputError(f"config section loss_scale: {error}") from None


@dataclasses.dataclass(frozen=True)
class DivergenceConfig:
    """When a run counts as diverged, and what it does then.

    Attributes:
        patience: Consecutive steps whose loss is non-finite (or above
            `max_loss`) that make the run diverged; 0: never.
        max_loss: A finite loss above this counts as exploded; `None`: only
            non-finite losses count.
        action: `rollback`: restore the last checkpoint and go on with the
            learning rate times `lr_factor`; `promote`: restore it and go on
            with every float16 layer in bfloat16 and every bfloat16 layer in
            float32; `stop`: end the run with an error, keeping the checkpoints.
        lr_factor: What `rollback` multiplies the learning rate by, in (0, 1).
        max_rollbacks: Rollbacks (or promotions) after which a divergence
            stops the run.
    """

    patience: int = 0
    max_loss: float | None = None
    action: str = "rollback"
    lr_factor: float = 0.5
    max_rollbacks: int = 3

    def __post_init__(self):
        _require_choice(self.action, "divergence.action", DIVERGENCE_ACTIONS)
        _require(self.patience >= 0, "divergence.patience", "an integer >= 0", self.patience)
        _require(
            self.max_loss is None or math.isfinite(self.max_loss),
            "divergence.max_loss",
            "null or a finite number",
            self.max_loss,
        )
        _require(
            0 < self.lr_factor < 1, "divergence.lr_factor", "a number in (0, 1)", self.lr_factor
        )
        _require(
            self.max_rollbacks >= 0,
            "divergence.max_rollbacks",
            "an integer >= 0",
            self.max_rollbacks,
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides what a run computes.

    Attributes:
        precision: Global dtype policy: `float32`, `mixed_float16`,
            `mixed_bfloat16` (or `auto`, resolved by hardware).
        manifest: Path of a precision manifest (layer-wise policies), or `None`.
        seed: Seed of weights initialisation and data order.
        steps: Total number of train steps of the run (a resumed run stops here).
        checkpoint_every: Steps between checkpoints; also the length of one
            Keras "epoch" of `model.fit`, so the progress bar reports per interval.
        eval_every: Steps between validations; a multiple of `checkpoint_every`.
        keep_checkpoints: Checkpoints kept in `model_dir/checkpoints`.
        log_every: Steps between TensorBoard summaries of the train metrics.
        strategy: tf.distribute strategy: one of `STRATEGIES`.
        virtual_cpus: Split the CPU into this many logical devices (0: off).
        tpu: Address of the TPU for strategy `tpu` (`None`: the local or
            environment-configured one).
        jit_compile: XLA compilation of the train step: `auto`, `true`, `false`.
        auto_promote: Promote layers that keep overflowing with the loss scale
            at its floor (see `mpt_keras.AutoPromote`); the promoted manifest
            is written to `model_dir/promoted_manifest.json`.
        deterministic: Seed everything and enable TensorFlow's op determinism
            (`tf.config.experimental.enable_op_determinism`), so two runs of
            the same config give identical weights.
        imports: Modules imported before any component is resolved (a user's
            custom layers registering themselves), from the working directory
            or `PYTHONPATH`.
        data: See `DataConfig`.
        model: See `ModelConfig`.
        loss: The training loss (see `ComponentConfig`); `None`: the
            reference models' sparse categorical cross-entropy on logits, or
            the loss a `model.file` was compiled with.
        metrics: The metrics (`ComponentConfig`s); `None`: accuracy for the
            reference models, a `model.file`'s compiled metrics, none for a
            `model.factory`.
        optimizer: See `OptimizerConfig`.
        loss_scale: See `LossScaleConfig`.
        divergence: See `DivergenceConfig`.
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
    imports: tuple[str, ...] = ()
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    loss: ComponentConfig | None = None
    metrics: tuple[ComponentConfig, ...] | None = None
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)
    divergence: DivergenceConfig = dataclasses.field(default_factory=DivergenceConfig)

    def __post_init__(self):
        _require_choice(self.precision, "precision", PRECISIONS)
        _require_choice(self.strategy, "strategy", STRATEGIES)
        _require_choice(self.jit_compile, "jit_compile", JIT_COMPILE)
        _require(0 <= self.seed <= _MAX_SEED, "seed", f"an integer in [0, {_MAX_SEED}]", self.seed)
        _require(self.steps >= 1, "steps", "an integer >= 1", self.steps)
        _require(
            self.checkpoint_every >= 1, "checkpoint_every", "an integer >= 1", self.checkpoint_every
        )
        _require(
            self.eval_every >= 1 and self.eval_every % self.checkpoint_every == 0,
            "eval_every",
            f"a positive multiple of checkpoint_every ({self.checkpoint_every})",
            self.eval_every,
        )
        _require(
            self.keep_checkpoints >= 1, "keep_checkpoints", "an integer >= 1", self.keep_checkpoints
        )
        _require(self.log_every >= 1, "log_every", "an integer >= 1", self.log_every)
        _require(self.virtual_cpus >= 0, "virtual_cpus", "an integer >= 0", self.virtual_cpus)
        _require(
            self.loss is not None or self.model.factory is None,
            "loss",
            "a loss (a Keras name or a factory) when the model comes from model.factory",
            None,
        )
        for index, module in enumerate(self.imports):
            _require(
                _MODULE_NAME.fullmatch(module) is not None,
                f"imports[{index}]",
                "a dotted module name such as 'my_project.layers'",
                module,
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> TrainConfig:
        """Builds a config from a JSON-like mapping, strictly.

        Args:
            values: Keys and values as in the JSON file; missing keys keep their
                defaults.
            source: What the values came from (a file name, a flag), for messages.

        Returns:
            The validated config.

        Raises:
            UserInputError: On an unknown key, a wrong type or a bad value.
        """
        try:
            return _build(cls, values, prefix="")
        except UserInputError as error:
            raise UserInputError(f"{source}: {error}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        """Reads a config file; see `from_dict`."""
        return cls.from_dict(read_json_object(path), source=os.fspath(path))

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-serialisable values (`from_dict` inverts it)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The config as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def merged(self, overrides: Mapping[str, Any], source: str = "override") -> TrainConfig:
        """Returns this config with `overrides` merged in, key by key.

        JSON objects (the sections and `model.options`) merge key by key; any
        other value replaces the one it overrides.

        Args:
            overrides: A JSON-like mapping shaped like the config file.
            source: What the overrides came from, for messages.

        Raises:
            UserInputError: As `from_dict`.
        """
        if not isinstance(overrides, Mapping):
            raise UserInputError(
                f"{source}: expected a JSON object, received {type(overrides).__name__}"
            )
        return TrainConfig.from_dict(_deep_merge(self.to_dict(), overrides), source=source)


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            section = dict(merged[key])
            if any(value.get(source) is not None for source in SOURCE_KEYS):
                # Another source: the old one and its options no longer apply.
                for stale in (*SOURCE_KEYS, "options"):
                    section.pop(stale, None)
            merged[key] = _deep_merge(section, value)
        else:
            merged[key] = value
    return merged


def _build(cls: type, values: Any, prefix: str) -> Any:
    """Instantiates dataclass `cls` from `values`, checking keys and types."""
    if not isinstance(values, Mapping):
        raise UserInputError(
            f"{prefix.rstrip('.') or 'config'} must be a JSON object, received {json.dumps(values)}"
        )
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserInputError(
            f"unknown key '{prefix}{unknown[0]}'. Allowed keys"
            f"{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _convert(hints[name], value, f"{prefix}{name}")
    if cls is not ComponentConfig:
        return cls(**kwargs)
    try:
        return cls(**kwargs)
    except UserInputError as error:
        # A loss or metric knows not its own key: say which one it is.
        raise UserInputError(f"{prefix.rstrip('.')}: {error}") from None


def _convert(hint: Any, value: Any, key: str) -> Any:
    """Checks `value` against type `hint`, recursing into nested dataclasses."""
    allowed = (
        typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
    )
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is ComponentConfig and isinstance(value, str):
            return _build(kind, {"name": value}, prefix=key + ".")
        if dataclasses.is_dataclass(kind):
            return _build(kind, value, prefix=key + ".")
        if typing.get_origin(kind) is tuple and isinstance(value, (list, tuple)):
            item = typing.get_args(kind)[0]
            return tuple(
                _convert(item, part, f"{key}[{index}]") for index, part in enumerate(value)
            )
        if kind is bool and isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not abs(value) <= sys.float_info.max:  # NaN, infinities, ints beyond floats
                raise UserInputError(
                    f"key '{key}' must be a finite number, received {json.dumps(value)}"
                )
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is Mapping and isinstance(value, Mapping):
            return dict(value)
    names = " or ".join(
        _TYPE_NAMES.get(typing.get_origin(kind) or kind, str(kind)) for kind in allowed
    )
    raise UserInputError(f"key '{key}' must be {names}, received {json.dumps(value)}")


_UnionType = type(int | None)
_TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    Mapping: "a JSON object",
    tuple: "a JSON array",
    type(None): "null",
}


def _require(ok: bool, key: str, allowed: str, received: Any) -> None:
    if not ok:
        raise UserInputError(f"key '{key}' must be {allowed}, received {json.dumps(received)}")


def _require_one_source(config: Any, section: str, keys: tuple[str, ...]) -> None:
    """Checks that `config` names exactly one of `keys`, and a factory's syntax."""
    given = [key for key in keys if getattr(config, key) is not None]
    where = f"{section}: " if section else ""
    if len(given) != 1:  # None given: only a loss or metric, the others have a default.
        received = " and ".join(f"'{key}'" for key in given) or "none"
        raise UserInputError(
            f"{where}exactly one source is allowed: {', '.join(repr(key) for key in keys)}; "
            f"received {received}"
        )
    if config.factory is not None and not FACTORY_SYNTAX.fullmatch(config.factory):
        raise UserInputError(
            f"key '{section + '.' if section else ''}factory' must be "
            f"'package.module:attribute', received {json.dumps(config.factory)}"
        )


def _is_feature_map(features: Mapping[str, Any]) -> bool:
    """Whether `features` is `{"x": FEATURE or {INPUT: FEATURE}, "y": FEATURE}`."""
    x = features.get("x")
    return (
        set(features) == {"x", "y"}
        and isinstance(features["y"], str)
        and (
            isinstance(x, str)
            or (isinstance(x, Mapping) and bool(x) and all(isinstance(v, str) for v in x.values()))
        )
    )


def _require_choice(value: str, key: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserInputError(
            f"key '{key}' must be one of {', '.join(choices)}; received {json.dumps(value)}"
        )


def resolve_config(
    path: str | os.PathLike,
    config_override: str | None = None,
    **flag_values: Any,
) -> TrainConfig:
    """Resolves a run's config: the file, then `config_override`, then flags.

    Args:
        path: The config file.
        config_override: A JSON object (text) merged into the file's config.
        **flag_values: Top-level keys set by dedicated flags (`precision`,
            `steps`, ...); `None` values are left to the file.

    Returns:
        The resolved config.

    Raises:
        UserInputError: Naming the file, `--config_override` or `--<flag>` that
            was wrong.
    """
    config = TrainConfig.from_json(path)
    check_files(config, os.fspath(path))
    if config_override:
        overrides = parse_json_object(config_override, "--config_override")
        config = config.merged(overrides, source="--config_override")
    for name, value in flag_values.items():
        if value is not None:
            config = config.merged({name: value}, source=f"--{name}")
    check_files(config, "--config_override")
    return config


def check_files(config: TrainConfig, source: str = "config") -> None:
    """Checks that the files a config names exist: the manifest and a model file.

    Raises:
        UserInputError: Naming the key and the path.
    """
    for key, path in (("manifest", config.manifest), ("model.file", config.model.file)):
        if path is not None and not os.path.isfile(path):
            raise UserInputError(f"{source}: key '{key}': no such file {path!r}")
