"""`run_training`: a training run, from a config to the files in its `model_dir`.

config -> components resolved (`runs`) -> strategy -> data -> (under the
strategy's scope) the run assembled: model, precision, optimizer, compiled
step -> `config.json` written -> restore the latest checkpoint -> data from
the restored step -> `model.fit` with checkpoints and telemetry -> final
validation -> `model.keras`, the serving model and SavedModel (`serving`),
and `metrics.json` in `model_dir`.

The run is cut into Keras epochs of `checkpoint_every` steps: the progress bar
reports per interval, a checkpoint is saved at the end of each, and a rerun on
the same `model_dir` resumes at the exact step it reached.

Guards (`mpt_keras.reliability.guards`) watch the run: batches with NaN or Inf values are
skipped, reported and limited (`data.max_bad_batches`); a divergence
(`divergence.patience` steps with a non-finite or exploded loss) rolls the run
back to its last checkpoint saved while the loss was healthy, with a lower
learning rate or promoted layers, or stops it (`DivergenceConfig`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from mpt_keras import models
from mpt_keras.backend.tensorflow import distribute
from mpt_keras.backend.tensorflow.checkpoints import Checkpointer, SaveCheckpoints
from mpt_keras.config import TrainConfig
from mpt_keras.errors import RunStoppedError, UserInputError
from mpt_keras.files import (
    check_creatable_dir,
    check_writable_dir,
    write_json_atomic,
    write_text_atomic,
)
from mpt_keras.keras_bridge.callbacks import IntervalProgbar, StopAtStep
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.promote import promote
from mpt_keras.precision.report import PrecisionReport
from mpt_keras.reliability.auto_promote import AutoPromote
from mpt_keras.reliability.guards import BadBatchLimit, Diverged, DivergenceGuard
from mpt_keras.runs import assembly as runs
from mpt_keras.runs import serving
from mpt_keras.telemetry.metrics_csv import MetricsCsv
from mpt_keras.telemetry.monitor import MixedPrecisionMonitor
from mpt_keras.telemetry.prometheus import PrometheusExporter

CONFIG_FILE = "config.json"
PRECISION_REPORT_FILE = "precision_report.json"
METRICS_FILE = "metrics.json"
# math.exp raises OverflowError above it.
_LOG_FLOAT_MAX = math.log(sys.float_info.max)
METRICS_CSV_FILE = "metrics.csv"
MODEL_FILE = "model.keras"
PROMOTED_MANIFEST_FILE = "promoted_manifest.json"
LOGS_SUBDIR = "logs"
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
        metrics_port: Serve the run's Prometheus metrics on this port, from
            the chief (`mpt_keras.telemetry.prometheus`); None: no endpoint.
    """

    model_dir: str
    verbose: int | None = None
    callbacks: tuple[keras.callbacks.Callback, ...] = ()
    metrics_port: int | None = None


def run_training(config: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    """Trains `config` into `runtime.model_dir`, resuming from its checkpoints.

    The config is checked whole before anything is written: its components are
    resolved and bound (`runs.resolve_components`), the data loaded, the model
    built, its manifest applied and its optimizer made; only then is
    `config.json` written, so a bad value never locks a `model_dir`.

    Args:
        config: The resolved run configuration.
        runtime: Where the run writes and how it reports progress.

    Returns:
        The final metrics, as written to `metrics.json`: `step`, `precision`,
        `loss_scale`, `skipped_steps` (steps whose gradients were non-finite,
        so not applied), `bad_batches` (those of them whose batch held a NaN
        or Inf), and the validation metrics (`val_loss`, one per metric, and
        for the reference language model `val_perplexity` and
        `val_bits_per_byte`).

    Raises:
        UserInputError: For a bad config, manifest, dataset or `model_dir`.
        RunStoppedError: When a guard stops the run: more bad batches than
            `data.max_bad_batches`, or a divergence `divergence` cannot mend.
    """
    components = runs.resolve_components(config)
    _check_model_dir(runtime.model_dir, config)
    # Splitting the CPU into virtual devices must precede any TF op.
    strategy = distribute.make_strategy(config.strategy, config.virtual_cpus, config.tpu)
    exporter = None
    if runtime.metrics_port is not None and distribute.is_chief(strategy):
        exporter = PrometheusExporter(
            runtime.metrics_port,
            run_name=os.path.basename(os.path.normpath(runtime.model_dir)),
            examples_per_step=config.data.batch_size,
            update_every=config.log_every,
        )
    try:
        with _op_determinism(config.deterministic):
            return _run(config, runtime, strategy, components, exporter)
    finally:
        if exporter is not None:
            exporter.close()


def _run(
    config: TrainConfig,
    runtime: Runtime,
    strategy: tf.distribute.Strategy,
    components: runs.Components,
    exporter: PrometheusExporter | None,
) -> dict[str, Any]:
    chief = distribute.is_chief(strategy)
    model_dir = runtime.model_dir
    # Before the data, which a first run prepares: a bad manifest fails at once.
    manifest_file = PrecisionManifest.from_json(config.manifest) if config.manifest else None
    run_data = components.data()

    with distribute.peer_failures_as_errors(strategy, model_dir), strategy.scope():
        run = runs.assemble(config, components, run_data, manifest_file)
        # Everything is checked: now the run may claim model_dir.
        _prepare_model_dir(model_dir, config, write_config=chief)
        with distribute.worker_write_dir(model_dir, strategy) as write_dir:
            checkpointer = Checkpointer(
                model_dir,
                run.model,
                run.optimizer,
                keep=config.keep_checkpoints,
                write_dir=write_dir,
                extra_variables={"learning_rate_scale": runs.learning_rate_scale(run.optimizer)},
            )
            step = checkpointer.restore()
            if chief:
                write_json_atomic(
                    os.path.join(model_dir, PRECISION_REPORT_FILE), run.report.to_dict()
                )
            validation = _sharded_by_data(run_data.eval_batches(config.data.eval_batch_size))
            if step < config.steps:
                fit = _Fit(
                    run.model,
                    run.manifest,
                    config,
                    runtime,
                    checkpointer,
                    run_data,
                    validation,
                    exporter,
                )
                _fit(fit, step)
            else:
                _LOGGER.info("Step %d of %d already done: evaluating only.", step, config.steps)
            metrics = _final_metrics(run.model, validation, components.task, run.report)
            # Every worker saves (saving reads variables collectively); the chief's counts.
            _save_model_atomic(run.model, os.path.join(write_dir, MODEL_FILE))
            _save_for_users(run.model, write_dir)
    if chief:
        write_json_atomic(os.path.join(model_dir, METRICS_FILE), metrics)
    _LOGGER.info("Final metrics: %s", metrics)
    return metrics


def _check_model_dir(model_dir: str, config: TrainConfig) -> None:
    """Refuses a `model_dir` that cannot be written or holds a different run; writes nothing."""
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


def _prepare_model_dir(model_dir: str, config: TrainConfig, write_config: bool) -> None:
    """Creates `model_dir`, refusing one that cannot be written or has too little
    space (`files.check_writable_dir`), and writes the run's config into it."""
    check_writable_dir(model_dir, what="model_dir")
    if write_config:
        write_text_atomic(os.path.join(model_dir, CONFIG_FILE), config.to_json())


def _save_for_users(model: keras.Model, write_dir: str) -> None:
    """What a user takes away besides `model.keras`: a model to serve (see `serving`).

    A model holding layers of mpt_keras (the reference Transformer's) has no
    `serving.keras`: its SavedModel serves it.
    """
    try:
        serving.save_for_serving(model, os.path.join(write_dir, serving.SERVING_MODEL_FILE))
    except serving.NotServableError as error:
        _LOGGER.warning("No %s: %s", serving.SERVING_MODEL_FILE, error)
    serving.export_saved_model(model, os.path.join(write_dir, serving.SAVED_MODEL_DIR))


@dataclasses.dataclass
class _Fit:
    """What the fit loop works with; a promotion replaces the manifest."""

    model: keras.Model
    manifest: PrecisionManifest
    config: TrainConfig
    runtime: Runtime
    checkpointer: Checkpointer
    data: runs.RunData
    validation: tf.data.Dataset
    exporter: PrometheusExporter | None


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
        scale = runs.learning_rate_scale(fit.model.optimizer)
        scale.assign(scale * fit.config.divergence.lr_factor)
        _LOGGER.warning("Learning rate scaled by %g.", float(scale.numpy()))
        return
    fit.manifest, promotions = promote(fit.model, fit.manifest, reason=f"divergence at {diverged}")
    if not promotions:
        raise RunStoppedError(
            f"training diverged at {diverged} with every layer in float32 already: "
            "divergence.action=promote has nothing to promote; lower the learning rate"
        )
    write_text_atomic(
        os.path.join(fit.runtime.model_dir, PROMOTED_MANIFEST_FILE), fit.manifest.to_json()
    )
    for promotion in promotions:
        _LOGGER.warning(
            "Layer %s promoted from %s to %s.", promotion.path, promotion.old, promotion.new
        )


def _fit_from(fit: _Fit, step: int, guard: DivergenceGuard | None) -> None:
    config, runtime = fit.config, fit.runtime
    interval = config.checkpoint_every
    train = _sharded_by_data(
        fit.data.train_batches(
            config.data.batch_size,
            seed=config.seed,
            start_step=step,
            shuffle_buffer=config.data.shuffle_buffer,
        )
    )
    first_epoch = step // interval
    verbose = runtime.verbose if runtime.verbose is not None else (1 if sys.stdout.isatty() else 2)
    _LOGGER.info(
        "Training steps %d..%d in intervals of %d (%s).",
        step + 1,
        config.steps,
        interval,
        f"manifest {config.manifest}" if config.manifest else config.precision,
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
            *([IntervalProgbar(config.steps)] if verbose else []),
            *([] if guard is None else [guard]),
            BadBatchLimit(config.data.max_bad_batches, check_every=config.log_every),
            MixedPrecisionMonitor(
                os.path.join(runtime.model_dir, LOGS_SUBDIR),
                update_freq=config.log_every,
                examples_per_step=config.data.batch_size,
                diagnosis_data=functools.partial(_batch_of_step, fit),
            ),
            MetricsCsv(os.path.join(runtime.model_dir, METRICS_CSV_FILE), config.log_every),
            *([] if fit.exporter is None else [fit.exporter]),
            SaveCheckpoints(fit.checkpointer, healthy=None if guard is None else guard.healthy),
            *_auto_promote(fit.manifest, config, runtime),
            *runtime.callbacks,
        ],
        shuffle=False,  # The stream is shuffled by the data pipeline, by step.
        verbose=verbose,
    )


def _batch_of_step(fit: _Fit, step: int) -> tuple[Any, ...]:
    """The global batch step `step` (1-based) trained on: the data is a function of the step."""
    config = fit.config
    batches = fit.data.train_batches(
        config.data.batch_size,
        seed=config.seed,
        start_step=step - 1,
        shuffle_buffer=config.data.shuffle_buffer,
    )
    return tuple(next(iter(batches.take(1))))


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
    model: keras.Model, validation, task: str | None, report: PrecisionReport
) -> dict[str, Any]:
    results = model.evaluate(validation, return_dict=True, verbose=0)
    optimizer = model.optimizer
    health = optimizer.health()
    metrics: dict[str, Any] = {
        "step": int(optimizer.iterations.numpy()),
        "precision": report.precision,
        "loss_scale": health.loss_scale,
        "skipped_steps": health.skipped_steps,
        "bad_batches": health.bad_batches,
    }
    metrics.update({f"val_{name}": float(value) for name, value in results.items()})
    if task == models.LANGUAGE_MODEL:
        loss = metrics["val_loss"]
        # A diverged run's loss may be past what exp() takes: its perplexity is inf.
        metrics["val_perplexity"] = math.inf if loss > _LOG_FLOAT_MAX else math.exp(loss)
        metrics["val_bits_per_byte"] = metrics["val_loss"] / math.log(2)
    return metrics


def _save_model_atomic(model: keras.Model, path: str) -> None:
    # Keras insists on the .keras suffix, so the temporary name keeps it.
    partial = os.path.join(os.path.dirname(path), ".partial." + os.path.basename(path))
    model.save(partial)
    os.replace(partial, path)
