"""`run_training`: the composition root of a training run.

config -> strategy -> (under the precision policy and the strategy's scope)
model -> optimizer -> compile -> restore the latest checkpoint -> data from the
restored step -> `model.fit` with checkpoints and telemetry -> final validation
-> `model.keras` and `metrics.json` in `model_dir`.

The run is cut into Keras epochs of `checkpoint_every` steps: the progress bar
reports per interval, a checkpoint is saved at the end of each, and a rerun on
the same `model_dir` resumes at the exact step it reached.

Guards (`mpt_keras.guards`) watch the run: batches with NaN or Inf values are
skipped, reported and limited (`data.max_bad_batches`); a divergence
(`divergence.patience` steps with a non-finite or exploded loss) rolls the run
back to its last checkpoint saved while the loss was healthy, with a lower
learning rate or promoted layers, or stops it (`DivergenceConfig`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from mpt_keras import data, distribute, models, xla
from mpt_keras.auto_promote import AutoPromote
from mpt_keras.calibration import CalibrationResult, CalibrationThresholds, calibrate
from mpt_keras.callbacks import StopAtStep
from mpt_keras.checkpointing import Checkpointer, SaveCheckpoints
from mpt_keras.config import OptimizerConfig, TrainConfig
from mpt_keras.errors import RunStoppedError, UserInputError
from mpt_keras.files import write_json_atomic, write_text_atomic
from mpt_keras.guards import (
    BadBatchLimit,
    Diverged,
    DivergenceGuard,
    ScaledLearningRate,
    promote_low_precision_layers,
)
from mpt_keras.loss_scale_optimizer import LossScaleOptimizer
from mpt_keras.manifest import PrecisionManifest
from mpt_keras.monitor import MixedPrecisionMonitor
from mpt_keras.policies import global_policy, resolve_auto_policy

CONFIG_FILE = "config.json"
PRECISION_REPORT_FILE = "precision_report.json"
METRICS_FILE = "metrics.json"
MODEL_FILE = "model.keras"
PROMOTED_MANIFEST_FILE = "promoted_manifest.json"
LOGS_SUBDIR = "logs"
# Every reference model ends in logits over classes or the next token.
TRAINING_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_LOGGER = logging.getLogger(__name__)

# A rerun on an existing model_dir may change only how long and where it runs
# (the global batch stays the same), not what it computes: the checkpoint would
# not match, or would mean another run.
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
    }
)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where and how a run executes; nothing here changes what it computes.

    Attributes:
        model_dir: Directory of the run's outputs and checkpoints.
        verbose: Keras `fit` verbosity; `None` shows a progress bar on a
            terminal and one line per checkpoint interval otherwise.
        callbacks: More Keras callbacks for `model.fit`, after the toolkit's.
    """

    model_dir: str
    verbose: int | None = None
    callbacks: tuple[keras.callbacks.Callback, ...] = ()


@dataclasses.dataclass(frozen=True)
class _TaskData:
    train: tuple[np.ndarray, np.ndarray]
    validation: tuple[np.ndarray, np.ndarray]
    model_dimensions: dict[str, Any]


def run_training(config: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    """Trains `config` into `runtime.model_dir`, resuming from its checkpoints.

    Args:
        config: The resolved run configuration.
        runtime: Where the run writes and how it reports progress.

    Returns:
        The final metrics, as written to `metrics.json`: `step`, `precision`,
        `loss_scale`, `skipped_steps` (steps whose gradients were non-finite,
        so not applied), `bad_batches` (those of them whose batch held a NaN
        or Inf), and the validation metrics (`val_loss`,
        `val_accuracy`, and for language models `val_perplexity` and
        `val_bits_per_byte`).

    Raises:
        UserInputError: For a bad config, manifest, dataset or `model_dir`.
        RunStoppedError: When a guard stops the run: more bad batches than
            `data.max_bad_batches`, or a divergence `divergence` cannot mend.
    """
    # First: splitting the CPU into virtual devices must precede any TF op.
    strategy = distribute.make_strategy(config.strategy, config.virtual_cpus, config.tpu)
    with _op_determinism(config.deterministic):
        return _run(config, runtime, strategy)


def _run(config: TrainConfig, runtime: Runtime, strategy: tf.distribute.Strategy) -> dict[str, Any]:
    chief = distribute.is_chief(strategy)
    model_dir = runtime.model_dir
    _prepare_model_dir(model_dir, config, write_config=chief)
    task = models.model_task(config.model.name)
    # Before the data, which a first run prepares: a bad manifest fails at once.
    manifest_file = PrecisionManifest.from_json(config.manifest) if config.manifest else None
    task_data = _load_data(config, task)

    with (
        distribute.peer_failures_as_errors(strategy, model_dir),
        distribute.worker_write_dir(model_dir, strategy) as write_dir,
        strategy.scope(),
    ):
        model, manifest, report = _build_model(config, task_data, manifest_file)
        optimizer = _make_optimizer(config, report)
        jit_compile, jit_reason = xla.resolve_jit_compile(
            config.jit_compile, strategy, report["precision"], model
        )
        _LOGGER.info("%s", jit_reason)
        report = {**report, "jit_compile": jit_compile, "jit_compile_reason": jit_reason}
        xla.compile_model(
            model,
            optimizer=optimizer,
            loss=TRAINING_LOSS,
            metrics=["accuracy"],
            jit_compile=jit_compile,
        )
        optimizer.build(model.trainable_variables)
        checkpointer = Checkpointer(
            model_dir,
            model,
            optimizer,
            keep=config.keep_checkpoints,
            write_dir=write_dir,
            extra_variables={"learning_rate_scale": _learning_rate_scale(optimizer)},
        )
        step = checkpointer.restore()
        if chief:
            write_json_atomic(os.path.join(model_dir, PRECISION_REPORT_FILE), report)

        validation = _sharded_by_data(
            data.eval_batches(*task_data.validation, config.data.eval_batch_size)
        )
        if step < config.steps:
            fit = _Fit(model, manifest, config, runtime, checkpointer, task_data, validation)
            _fit(fit, step)
        else:
            _LOGGER.info("Step %d of %d already done: evaluating only.", step, config.steps)
        metrics = _final_metrics(model, validation, task, report)
        # Every worker saves (saving reads variables collectively); the chief's counts.
        _save_model_atomic(model, os.path.join(write_dir, MODEL_FILE))
    if chief:
        write_json_atomic(os.path.join(model_dir, METRICS_FILE), metrics)
    _LOGGER.info("Final metrics: %s", metrics)
    return metrics


def plan_precision(config: TrainConfig) -> dict[str, Any]:
    """Builds the run's model and reports each layer's precision; trains nothing.

    This is what `mpt-train --dry_run` prints, and what a run writes to
    `precision_report.json`.

    Returns:
        The report: `precision` (the run's policy, `auto` resolved),
        `precision_reason` (why, for `auto`), `manifest` (its path or null),
        and the manifest report's `layers` (path, class, policy,
        compute_dtype, variable_dtype, decided_by, reason),
        `trainable_variables`, `unmatched_rules` and `shadowed_rules`.
    """
    task_data = _load_data(config, models.model_task(config.model.name))
    return _build_model(config, task_data)[2]


def format_precision_table(report: Mapping[str, Any]) -> str:
    """The layers of a precision report as an aligned text table."""
    columns = ("path", "class", "policy", "decided_by")
    rows = [columns] + [tuple(str(layer[key]) for key in columns) for layer in report["layers"]]
    widths = [max(len(row[index]) for row in rows) for index in range(len(columns))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    ]
    return "\n".join(lines) + "\n"


def run_calibration(
    config: TrainConfig,
    output: str | os.PathLike,
    stats_output: str | os.PathLike | None = None,
    steps: int = 8,
    thresholds: CalibrationThresholds = CalibrationThresholds(),
) -> CalibrationResult:
    """Calibrates the model and train data of a run config; writes the manifest.

    The model is built as `run_training` builds it (same seed, in float32) and
    fed the run's first `steps` train batches; the loss scale is the config's
    `loss_scale.initial_scale`. This is what `mpt-calibrate` runs.

    Args:
        config: A resolved `TrainConfig`.
        output: Where the manifest goes (a `mpt-train --manifest` file).
        stats_output: Where the statistics go; default `<output stem>.stats.json`.
        steps: Batches to measure.
        thresholds: The decision thresholds.

    Returns:
        The calibration result.

    Example:

        config = resolve_config("configs/python_source_transformer.json")
        run_calibration(config, "/tmp/transformer.json", steps=4)
    """
    float32_config = dataclasses.replace(config, precision="float32", manifest=None)
    task_data = _load_data(float32_config, models.model_task(config.model.name))
    model, _, _ = _build_model(float32_config, task_data)
    batches = data.train_batches(*task_data.train, config.data.batch_size, seed=config.seed)
    result = calibrate(
        model,
        batches,
        TRAINING_LOSS,
        steps=steps,
        seed=config.seed,
        thresholds=thresholds,
        initial_scale=float(config.loss_scale.initial_scale),
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


def _build_model(
    config: TrainConfig, task_data: _TaskData, manifest_file: PrecisionManifest | None = None
) -> tuple[keras.Model, PrecisionManifest, dict[str, Any]]:
    """Builds the model and gives each layer its policy.

    `manifest_file` is `config.manifest` if the caller has read it already.

    Returns:
        The model, the manifest applied to it, and the precision report.

    Without a manifest, `precision` is the default of a manifest with the safe
    defaults only (normalization layers and the outputs stay float32); a
    manifest decides every layer and overrides `precision`.
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
        model = models.build_model(
            config.model.name, config.model.options, **task_data.model_dimensions
        )
        applied = manifest.apply(model)
    for rule in applied.unmatched_rules:
        _LOGGER.warning("Manifest rule %s matched no layer.", rule)
    for rule in applied.shadowed_rules:
        _LOGGER.warning("Manifest rule %s only matched layers an earlier rule decided.", rule)
    report = {
        "precision": manifest.default if config.manifest else precision,
        "precision_reason": reason,
        "manifest": config.manifest,
        **applied.to_dict(),
    }
    return model, manifest, report


def _resolve_precision(precision: str) -> tuple[str, str | None]:
    if precision != "auto":
        return precision, None
    policy, reason = resolve_auto_policy()
    _LOGGER.info("precision auto -> %s: %s", policy, reason)
    return policy, reason


def _prepare_model_dir(model_dir: str, config: TrainConfig, write_config: bool) -> None:
    """Creates `model_dir`, refusing one that holds a different run, or that
    cannot be written or has too little space (`files.check_writable_dir`)."""
    from mpt_keras.files import check_writable_dir  # Local: keeps this edit in one function.

    check_writable_dir(model_dir, what="model_dir")
    config_path = os.path.join(model_dir, CONFIG_FILE)
    if os.path.exists(config_path):
        previous = TrainConfig.from_json(config_path).to_dict()
        current = config.to_dict()
        changed = sorted(
            key
            for key in current
            if current[key] != previous[key] and key not in _RESUMABLE_CHANGES
        )
        if changed:
            raise UserInputError(
                f"model_dir {model_dir} holds a run whose '{changed[0]}' differs "
                f"({previous[changed[0]]!r} there, {current[changed[0]]!r} now): use a new "
                f"model_dir, or change only {', '.join(sorted(_RESUMABLE_CHANGES))} to resume"
            )
    if write_config:
        write_text_atomic(config_path, config.to_json())


def _load_data(config: TrainConfig, task: str) -> _TaskData:
    source = config.data
    if task == models.CLASSIFICATION:
        train = data.classification_arrays(source.name, source.train_split, source.data_dir)
        validation = data.classification_arrays(source.name, source.eval_split, source.data_dir)
        dimensions = {"input_shape": train.features.shape[1:], "num_classes": train.num_classes}
        train_arrays = (train.features, train.labels)
        validation_arrays = (validation.features, validation.labels)
    else:
        train_arrays = data.language_model_windows(
            source.name, source.train_split, source.data_dir, source.sequence_length
        )
        validation_arrays = data.language_model_windows(
            source.name, source.eval_split, source.data_dir, source.sequence_length
        )
        dimensions = {"vocab_size": data.VOCAB_SIZE, "sequence_length": source.sequence_length}
    if source.eval_examples:
        validation_arrays = tuple(array[: source.eval_examples] for array in validation_arrays)
    return _TaskData(train_arrays, validation_arrays, dimensions)


def _make_optimizer(config: TrainConfig, report: Mapping[str, Any]) -> LossScaleOptimizer:
    settings = config.optimizer
    # Scaled, so that a divergence rollback can lower it (a checkpointed variable).
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
    if any(layer["compute_dtype"] == "float16" for layer in report["layers"]):
        scaling = dataclasses.asdict(config.loss_scale)
    else:
        # Nothing to scale, but non-finite steps are still skipped and counted.
        scaling = {"initial_scale": 1.0, "min_scale": 1.0, "max_scale": 1.0, "dynamic": False}
    try:
        return LossScaleOptimizer(inner, **scaling)
    except UserInputError as error:
        raise UserInputError(f"config section loss_scale: {error}") from None


def _learning_rate_scale(optimizer: LossScaleOptimizer) -> keras.Variable:
    """The scale of the `ScaledLearningRate` that `_make_optimizer` gave `optimizer`."""
    return optimizer.inner_optimizer._learning_rate.scale


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


@dataclasses.dataclass
class _Fit:
    """What the fit loop works with; a promotion replaces the manifest."""

    model: keras.Model
    manifest: PrecisionManifest
    config: TrainConfig
    runtime: Runtime
    checkpointer: Checkpointer
    task_data: _TaskData
    validation: tf.data.Dataset


def _fit(fit: _Fit, step: int) -> None:
    """Trains from `step` to `config.steps`, rolling back on divergence."""
    divergence = fit.config.divergence
    if divergence.patience and step == 0:
        fit.checkpointer.save(0)  # Something to roll back to.
    rollbacks = 0
    while True:
        guard = DivergenceGuard(divergence.patience, divergence.max_loss)
        try:
            _fit_from(fit, step, guard if divergence.patience else None)
            return
        except Diverged as diverged:
            rollbacks += 1
            if divergence.action == "stop" or rollbacks > divergence.max_rollbacks:
                done = "" if divergence.action == "stop" else f" after {rollbacks - 1} rollbacks"
                raise RunStoppedError(
                    f"training diverged at {diverged}{done}; divergence.action="
                    f"{divergence.action}: stopped, the checkpoints in {fit.runtime.model_dir} "
                    "are kept (all saved while the loss was healthy)"
                ) from None
            step = fit.checkpointer.restore()
            _mend(fit, diverged)
            _LOGGER.warning(
                "Training diverged at %s: rolled back to step %d (rollback %d of %d).",
                diverged,
                step,
                rollbacks,
                divergence.max_rollbacks,
            )


def _mend(fit: _Fit, diverged: Diverged) -> None:
    """Applies the divergence action after a rollback."""
    if fit.config.divergence.action == "rollback":
        scale = _learning_rate_scale(fit.model.optimizer)
        scale.assign(scale * fit.config.divergence.lr_factor)
        _LOGGER.warning("Learning rate scaled by %g.", float(scale.numpy()))
        return
    fit.manifest, promoted = promote_low_precision_layers(
        fit.model, fit.manifest, reason=f"divergence at {diverged}"
    )
    if not promoted:
        raise RunStoppedError(
            f"training diverged at {diverged} with every layer in float32 already: "
            "divergence.action=promote has nothing to promote; lower the learning rate"
        )
    fit.model.make_train_function(force=True)
    write_text_atomic(
        os.path.join(fit.runtime.model_dir, PROMOTED_MANIFEST_FILE), fit.manifest.to_json()
    )
    for path, old, new in promoted:
        _LOGGER.warning("Layer %s promoted from %s to %s.", path, old, new)


def _fit_from(fit: _Fit, step: int, guard: DivergenceGuard | None) -> None:
    config, runtime = fit.config, fit.runtime
    interval = config.checkpoint_every
    train = _sharded_by_data(
        data.train_batches(
            *fit.task_data.train, config.data.batch_size, seed=config.seed, start_step=step
        )
    )
    first_epoch = step // interval
    verbose = runtime.verbose if runtime.verbose is not None else (1 if sys.stdout.isatty() else 2)
    _LOGGER.info(
        "Training steps %d..%d in intervals of %d (%s).",
        step + 1,
        config.steps,
        interval,
        config.precision,
    )
    fit.model.fit(
        train,
        initial_epoch=first_epoch,
        epochs=first_epoch + math.ceil((config.steps - step) / interval),
        steps_per_epoch=interval,
        validation_data=fit.validation,
        validation_freq=config.eval_every // interval,
        callbacks=[
            StopAtStep(config.steps),
            *([] if guard is None else [guard]),
            BadBatchLimit(config.data.max_bad_batches, check_every=config.log_every),
            MixedPrecisionMonitor(
                os.path.join(runtime.model_dir, LOGS_SUBDIR),
                update_freq=config.log_every,
                examples_per_step=config.data.batch_size,
            ),
            SaveCheckpoints(fit.checkpointer, healthy=None if guard is None else guard.healthy),
            *_auto_promote(fit.manifest, config, runtime),
            *runtime.callbacks,
        ],
        shuffle=False,  # The stream is shuffled by the data pipeline, by step.
        verbose=verbose,
    )


def _auto_promote(
    manifest: PrecisionManifest, config: TrainConfig, runtime: Runtime
) -> list[AutoPromote]:
    if not config.auto_promote:
        return []
    return [
        AutoPromote(
            manifest,
            check_every=config.log_every,
            manifest_path=os.path.join(runtime.model_dir, PROMOTED_MANIFEST_FILE),
            log_dir=os.path.join(runtime.model_dir, LOGS_SUBDIR),
        )
    ]


@contextlib.contextmanager
def _op_determinism(enabled: bool) -> Iterator[None]:
    """Enables TensorFlow's op determinism for the run, if asked; restores it after."""
    # Public: enable_op_determinism; TensorFlow exports no inverse, this is its own.
    before = tf_config.is_op_determinism_enabled()
    if enabled and not before:
        tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        if enabled and not before:
            tf_config.disable_op_determinism()


def _sharded_by_data(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Marks a stream of global batches to be split by data across workers.

    Under a multi-worker strategy each worker then takes its part of every
    global batch (the batches come from memory, not files, to shard by), so
    all workers run the same steps; elsewhere the option does nothing.
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def _final_metrics(
    model: keras.Model, validation, task: str, report: Mapping[str, Any]
) -> dict[str, Any]:
    results = model.evaluate(validation, return_dict=True, verbose=0)
    optimizer = model.optimizer
    metrics: dict[str, Any] = {
        "step": int(optimizer.iterations.numpy()),
        "precision": report["precision"],
        "loss_scale": optimizer.loss_scale,
        "skipped_steps": optimizer.skipped_steps,
        "bad_batches": optimizer.bad_batches,
    }
    metrics.update({f"val_{name}": float(value) for name, value in results.items()})
    if task == models.LANGUAGE_MODEL:
        metrics["val_perplexity"] = math.exp(metrics["val_loss"])
        metrics["val_bits_per_byte"] = metrics["val_loss"] / math.log(2)
    return metrics


def _save_model_atomic(model: keras.Model, path: str) -> None:
    # Keras insists on the .keras suffix, so the temporary name keeps it.
    partial = os.path.join(os.path.dirname(path), ".partial." + os.path.basename(path))
    model.save(partial)
    os.replace(partial, path)
