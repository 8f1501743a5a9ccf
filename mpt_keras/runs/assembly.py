"""The run assembly: a config becomes components, data, a model and its compiled step.

Every run is built here, whoever asks: `mpt-train` (`training.run_training`),
validation's candidate and float32 baseline, the canary, calibration and
`--dry_run`. So a validation result speaks for the real run: the same model
factory, manifest, optimizer, loss and compiled train step (`xla.compile_model`).

    components = resolve_components(config)   # imports, factories bound: nothing built
    data = components.data()                  # RunData: unbatched, with its dimensions
    run = assemble(config, components, data)  # under a strategy's scope, if any

`Components` are where the model, data, loss and metrics come from, resolved
from a config (`resolve_components`: `components` binds the user's factories,
`keras_objects` resolves losses, metrics and model files, `data.sources`
loads the data) or given as the user's own objects (`components_from_objects`),
so the library's `validate` and `run_canary` take a model factory, datasets and
a loss with no config at all.

Why one module: it is the one place a run is put together; every step of the
assembly (components, model, precision, optimizer, compiled step) is short
and is read in the order a run is built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from mpt_keras import compat, models
from mpt_keras import data as data_lib
from mpt_keras.calibration.calibrate import CalibrationResult, CalibrationThresholds, calibrate
from mpt_keras.config import OptimizerConfig, TrainConfig
from mpt_keras.config import components as components_lib
from mpt_keras.data import RunData
from mpt_keras.errors import UserInputError, describe_error
from mpt_keras.execution import xla
from mpt_keras.files import write_text_atomic
from mpt_keras.precision.hardware import resolve_auto_policy
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.policies import global_policy
from mpt_keras.precision.report import PrecisionReport
from mpt_keras.reliability.guards import ScaledLearningRate
from mpt_keras.runs import keras_objects
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_LOGGER = logging.getLogger(__name__)
# The data shape each reference task reads a dataset in.
_SHAPES = {models.CLASSIFICATION: "image", models.LANGUAGE_MODEL: "text"}


@dataclasses.dataclass(frozen=True)
class Components:
    """Where a run's model, data, loss and metrics come from, resolved.

    Attributes:
        model: Returns a fresh model, given the data's dimensions as keyword
            arguments (it takes those it needs); called under the run's global
            dtype policy and seed.
        data: Loads the `RunData` (called once the run's strategy exists).
        loss: A Keras loss: an object, a function or an identifier.
        metrics: Makers of Keras metrics (as `model.compile` takes them): a
            metric object holds its state, so each model gets its own.
        task: `classification` or `language_model` for the reference models
            (the language models also report perplexity), else `None`.
    """

    model: Callable[..., keras.Model]
    data: Callable[[], RunData]
    loss: Any
    metrics: tuple[Callable[[], Any], ...]
    task: str | None = None


@dataclasses.dataclass(frozen=True)
class Run:
    """A model ready to train: built, its precision applied, compiled with our step.

    Attributes:
        model: The compiled model.
        manifest: The precision manifest applied to it.
        report: The precision report (`plan_precision`'s), with `jit_compile`
            and its reason.
        optimizer: Its `LossScaleOptimizer`.
        jit_compile: Whether XLA compiles the train step.
    """

    model: keras.Model
    manifest: PrecisionManifest
    report: PrecisionReport
    optimizer: LossScaleOptimizer
    jit_compile: bool


def resolve_components(config: TrainConfig) -> Components:
    """Resolves the config's model, data, loss and metrics, building nothing.

    Imports `config.imports`, then every factory, and binds each to its options;
    reads a `model.file`'s compiled loss and metrics. Nothing is built or
    written, so a bad reference or option fails before the run starts.

    Raises:
        UserInputError: Naming the key and what is allowed.
    """
    components_lib.import_modules(config.imports)
    source = config.model
    task = None
    if source.name is not None:
        task = models.model_task(source.name)
        model = functools.partial(models.build_model, source.name, source.options)
    elif source.factory is not None:
        model = components_lib.bind_factory(
            source.factory,
            source.options,
            "model.factory",
            provided=components_lib.DATA_DIMENSIONS,
        )
    else:
        model = functools.partial(keras_objects.load_model_file, source.file)
    compiled = keras_objects.compiled_with(source.file) if source.file else {}
    loss = keras_objects.loss_from(config.loss, source, compiled)
    metrics = keras_objects.metrics_from(config.metrics, source, compiled)
    data_factory = None
    if config.data.factory is not None:
        data_factory = components_lib.bind_factory(
            config.data.factory, config.data.options, "data.factory", provided=("seed",)
        )
    return Components(
        model=model,
        data=functools.partial(
            data_lib.load_run_data, config.data, config.seed, _SHAPES.get(task), data_factory
        ),
        loss=loss,
        metrics=metrics,
        task=task,
    )


def components_from_objects(
    model: keras.Model | Callable[[], keras.Model],
    data: tuple[Any, Any],
    loss: Any,
    metrics: Sequence[Any],
    batching: str,
) -> Components:
    """Components from the user's own objects, for the library's `validate` and canary.

    Args:
        model: A function returning a fresh model (called once per precision,
            under that precision's global policy), or a functional or
            Sequential model (cloned for each precision).
        data: `(train, eval)`: each a `tf.data.Dataset` of unbatched `(x, y)`
            or `(x, y, sample_weight)` elements, or a tuple `(x, y)` of arrays.
        loss: A Keras loss (object, function or identifier).
        metrics: Keras metrics.
        batching: The setting the run batches by, named in the error on a
            batched dataset.

    Raises:
        UserInputError: For data of another shape, or batched already.
    """
    if isinstance(model, keras.Model):
        original = model

        def model(**dimensions: Any) -> keras.Model:
            del dimensions
            return keras_objects.clone_model(original)

    elif callable(model):
        factory = model

        def model(**dimensions: Any) -> keras.Model:
            del dimensions
            return factory()

    else:
        raise UserInputError(
            f"model: received {type(model).__name__}. Allowed: a keras.Model or a function "
            "returning one"
        )
    if not (isinstance(data, tuple) and len(data) == 2):
        raise UserInputError(
            f"data: received {type(data).__name__}. Allowed: a tuple (train, eval) of "
            "tf.data.Datasets or of (x, y) array tuples"
        )
    run_data = RunData(
        data_lib.checked_split(data[0], "data[0]", batching),
        data_lib.checked_split(data[1], "data[1]", batching),
        {},
    )
    makers = tuple(functools.partial(keras_objects.fresh_metric, metric) for metric in metrics)
    return Components(model, lambda: run_data, loss, makers)


def build_model(
    config: TrainConfig,
    components: Components,
    data: RunData,
    manifest_file: PrecisionManifest | None = None,
) -> tuple[keras.Model, PrecisionManifest, PrecisionReport]:
    """Builds the model and gives each layer its policy; trains nothing.

    Without a manifest, `config.precision` is the default of a manifest with
    the safe defaults only (normalization layers and the outputs stay float32);
    a manifest decides every layer and overrides `precision`.

    Args:
        config: The run's config (seed, precision, manifest).
        components: Where the model comes from.
        data: The data, whose dimensions the model factory may take.
        manifest_file: `config.manifest`, if the caller has read it already.

    Returns:
        The model, the manifest applied to it, and its report: the run's
        `precision` (`auto` resolved), `precision_reason` and `manifest` file
        added to the manifest's report (the model traced on one evaluation
        example; each output dtype mismatch, unmatched and shadowed rule is
        logged as a warning).
    """
    precision, reason = _resolve_precision(config.precision)
    if config.manifest is None:
        manifest = PrecisionManifest(default=precision)
    else:
        manifest = manifest_file or PrecisionManifest.from_json(config.manifest)
        if manifest.default != precision:
            _LOGGER.info(
                "Manifest %s decides each layer's policy (default %s): precision %s is not used.",
                config.manifest,
                manifest.default,
                precision,
            )
    keras.utils.set_random_seed(config.seed)
    with global_policy(manifest.default):
        try:
            model = components.model(**data.dimensions)
        except UserInputError:
            raise
        except Exception as error:  # The user's code: its error, in one line.
            raise UserInputError(f"the model factory failed: {describe_error(error)}") from None
        if not isinstance(model, keras.Model):
            raise UserInputError(
                f"the model factory returned {type(model).__name__}. Allowed: a keras.Model"
            )
        # Before the manifest and the optimizer, which need every variable.
        example = build_on_data(model, data)
        applied = manifest.apply(model, inputs=example)
    for layer in applied.layers:
        if layer.path in applied.output_dtype_mismatches:
            _LOGGER.warning(
                "Layer %s (%s) computes in %s but outputs %s: an op in its call mixes in a "
                "%s value (a NumPy array, a variable) or casts to it; cast to "
                "self.compute_dtype if that is not meant.",
                layer.path,
                layer.layer_class,
                layer.compute_dtype,
                layer.output_dtype,
                layer.output_dtype,
            )
    for rule in applied.unmatched_rules:
        _LOGGER.warning("Manifest rule %s matched no layer.", rule)
    for rule in applied.shadowed_rules:
        _LOGGER.warning("Manifest rule %s only matched layers an earlier rule decided.", rule)
    report = dataclasses.replace(
        applied,
        precision=manifest.default if config.manifest else precision,
        precision_reason=reason,
        manifest=config.manifest,
    )
    return model, manifest, report


def build_on_data(model: keras.Model, data: RunData) -> Any:
    """Builds `model` on one evaluation example, unless it is built already.

    A subclassed model makes its variables on its first call.

    Returns:
        The example's inputs, a batch of one: what the precision report
        traces the model on.
    """
    example = keras.utils.unpack_x_y_sample_weight(next(iter(data.eval_batches(1))))[0]
    if not model.built:
        model(example)
    return example


def assemble(
    config: TrainConfig,
    components: Components,
    data: RunData,
    manifest_file: PrecisionManifest | None = None,
) -> Run:
    """Builds, applies the precision to, and compiles the run's model with our step.

    Call it under the run's strategy scope (none: the default strategy). The
    step is `xla.compile_model`'s, with XLA as `config.jit_compile` resolves
    for this strategy and model; the optimizer is built.

    Raises:
        UserInputError: For a bad manifest, model option or `loss_scale` value.
    """
    model, manifest, report = build_model(config, components, data, manifest_file)
    optimizer = make_optimizer(config, report)
    jit_compile, jit_reason = xla.resolve_jit_compile(
        config.jit_compile,
        tf.distribute.get_strategy(),
        report.precision,
        model,
        deterministic=config.deterministic,
    )
    _LOGGER.info("%s", jit_reason)
    report = dataclasses.replace(report, jit_compile=jit_compile, jit_compile_reason=jit_reason)
    xla.compile_model(
        model,
        optimizer=optimizer,
        loss=components.loss,
        metrics=[make() for make in components.metrics],
        jit_compile=jit_compile,
    )
    optimizer.build(model.trainable_variables)
    return Run(model, manifest, report, optimizer, jit_compile)


def make_optimizer(config: TrainConfig, report: PrecisionReport) -> LossScaleOptimizer:
    """The run's `LossScaleOptimizer` around its inner optimizer.

    The learning rate is a `ScaledLearningRate`, so that a divergence rollback
    can lower it (`learning_rate_scale`). Dynamic loss scaling with the
    config's `loss_scale` when a layer computes in float16; else the scale is
    pinned at 1 and non-finite steps are still skipped and counted.
    """
    settings = config.optimizer
    learning_rate = ScaledLearningRate(_learning_rate(settings, config.steps))
    clipping = {"global_clipnorm": settings.global_clipnorm}
    if settings.name == "adam":
        inner = keras.optimizers.Adam(learning_rate, **clipping)
    elif settings.name == "adamw":
        inner = keras.optimizers.AdamW(
            learning_rate, weight_decay=settings.weight_decay, **clipping
        )
    else:
        inner = keras.optimizers.SGD(learning_rate, momentum=0.9, **clipping)
    if any(layer.compute_dtype == "float16" for layer in report.layers):
        scaling = dataclasses.asdict(config.loss_scale)
    else:
        scaling = {"initial_scale": 1.0, "min_scale": 1.0, "max_scale": 1.0, "dynamic": False}
    return LossScaleOptimizer(inner, **scaling)  # The config checked the settings.


def learning_rate_scale(optimizer: LossScaleOptimizer) -> keras.Variable:
    """The scale of the `ScaledLearningRate` that `make_optimizer` gave `optimizer`."""
    return compat.learning_rate_schedule(optimizer.inner_optimizer).scale


def plan_precision(config: TrainConfig) -> PrecisionReport:
    """Builds the run's model and reports each layer's precision; trains nothing.

    This is what `mpt-train --dry_run` prints (`format_table()`), and what a
    run writes to `precision_report.json` (`to_dict()`) before `assemble`
    adds its `jit_compile` choice; see `build_model`.
    """
    components = resolve_components(config)
    return build_model(config, components, components.data())[2]


def run_calibration(
    config: TrainConfig,
    output: str | os.PathLike,
    stats_output: str | os.PathLike | None = None,
    steps: int = 8,
    thresholds: CalibrationThresholds = CalibrationThresholds(),
    float8: bool = False,
) -> CalibrationResult:
    """Calibrates the model and train data of a run config; writes the manifest.

    The model is built as `run_training` builds it (same components and seed,
    in float32) and fed the run's first `steps` train batches with its loss;
    the loss scale is the config's `loss_scale.initial_scale`. This is what
    `mpt-calibrate` runs.

    Args:
        config: A resolved `TrainConfig`.
        output: Where the manifest goes (a `mpt-train --manifest` file).
        stats_output: Where the statistics go; default `<output stem>.stats.json`.
        steps: Batches to measure.
        thresholds: The decision thresholds.
        float8: Write float8 rules for the Dense and EinsumDense layers
            recommended (`calibrate`'s `float8`).

    Returns:
        The calibration result.
    """
    float32_config = dataclasses.replace(config, precision="float32", manifest=None)
    components = resolve_components(float32_config)
    data = components.data()
    model, _, _ = build_model(float32_config, components, data)
    batches = data.train_batches(
        config.data.batch_size, config.seed, shuffle_buffer=config.data.shuffle_buffer
    )
    result = calibrate(
        model,
        batches,
        keras.losses.get(components.loss),
        steps=steps,
        seed=config.seed,
        thresholds=thresholds,
        initial_scale=float(config.loss_scale.initial_scale),
        float8=float8,
    )
    stats_path = stats_output or os.path.splitext(os.fspath(output))[0] + ".stats.json"
    for path, text in ((output, result.manifest.to_json()), (stats_path, result.to_json())):
        directory = os.path.dirname(os.fspath(path))
        try:
            os.makedirs(directory or ".", exist_ok=True)
        except OSError as error:
            raise UserInputError(f"{path}: cannot be written ({error.strerror})") from None
        write_text_atomic(path, text)
    return result


def _resolve_precision(precision: str) -> tuple[str, str | None]:
    if precision != "auto":
        return precision, None
    policy, reason = resolve_auto_policy()
    _LOGGER.info("precision auto -> %s: %s", policy, reason)
    return policy, reason


def _learning_rate(
    settings: OptimizerConfig, steps: int
) -> float | keras.optimizers.schedules.LearningRateSchedule:
    if settings.schedule == "constant" and not settings.warmup_steps:
        return settings.learning_rate
    warmup = settings.warmup_steps
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else settings.learning_rate,
        decay_steps=max(1, steps - warmup),
        alpha=1.0 if settings.schedule == "constant" else 0.0,
        warmup_target=settings.learning_rate if warmup else None,
        warmup_steps=warmup,
    )


def resolve(
    model: TrainConfig | keras.Model | Callable[[], keras.Model],
    *,
    data: tuple[Any, Any] | None = None,
    loss: Any = None,
    metrics: Sequence[Any] = (),
    config: TrainConfig | None = None,
) -> tuple[TrainConfig, Components]:
    """The settings and components of a run given as a config or as the user's objects.

    What the library's `validate`, `run_canary` and `calibrate`-like entry
    points take: either a `TrainConfig` (its components resolved), or a model
    (a factory or a functional/Sequential model) with `data` and `loss`, and
    optionally a `config` for the settings (optimizer, batch size, seed, loss
    scale, precision); its model, data, loss and metrics are not used then.

    Raises:
        UserInputError: For a config given twice, or objects without data or loss.
    """
    if isinstance(model, TrainConfig):
        if config is not None or data is not None or loss is not None or metrics:
            raise UserInputError(
                "a TrainConfig names its own components: received it with data, loss, metrics "
                "or config too. Allowed: a TrainConfig alone, or a model with data and loss"
            )
        return model, resolve_components(model)
    if data is None or loss is None:
        missing = "data" if data is None else "loss"
        raise UserInputError(
            f"{missing}: required with a model of your own. Allowed: data=(train, eval) "
            "and loss=a Keras loss"
        )
    config = config or TrainConfig()
    batching = f"config.data.batch_size: {config.data.batch_size}"
    return config, components_from_objects(model, data, loss, metrics, batching)
