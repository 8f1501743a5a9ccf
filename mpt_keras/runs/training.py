"""`run_training`: a config to the files in its `model_dir`.

Components, strategy, data, the run assembled in scope, only then `config.json`; then the
latest checkpoint, the fit loop, the final metrics and models.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from typing import Any

import keras

from mpt_keras import models
from mpt_keras.backend import current
from mpt_keras.config import TrainConfig
from mpt_keras.files import write_json_atomic
from mpt_keras.keras_bridge import task_models
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.report import PrecisionReport
from mpt_keras.runs import fit_loop, placement, serving
from mpt_keras.runs.assembly import assemble, learning_rate_scale
from mpt_keras.runs.model_dir import (
    METRICS_FILE,
    MODEL_FILE,
    PRECISION_REPORT_FILE,
    check_model_dir,
    prepare_model_dir,
)
from mpt_keras.runs.resolution import Components, resolve_components
from mpt_keras.telemetry.prometheus import PrometheusExporter

# math.exp raises OverflowError above it.
_LOG_FLOAT_MAX = math.log(sys.float_info.max)
_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where and how a run executes; nothing here changes what it computes.

    `verbose`: `fit`'s; `None`: a progress bar on a terminal, else a line per checkpoint
    interval. `callbacks`: after ours. `metrics_port`: the chief's Prometheus port.
    """

    model_dir: str
    verbose: int | None = None
    callbacks: tuple[keras.callbacks.Callback, ...] = ()
    metrics_port: int | None = None


def run_training(config: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    """Trains `config` into `runtime.model_dir`, resuming from its checkpoints.

    The config is checked whole before `config.json` is written: a bad value never locks a
    `model_dir`. Returns `metrics.json`'s values (`step`, `precision`, `loss_scale`,
    `skipped_steps`, `bad_batches`, `val_` metrics; the LM's `val_perplexity`,
    `val_bits_per_byte`).

    Raises:
        UserInputError: For a bad config, manifest, dataset or `model_dir`.
        RunStoppedError: When a guard stops the run (bad batches, divergence).
    """
    # Splitting the CPU into virtual devices must precede any backend operation: on JAX before
    # the config's components (checking a metric's name makes one, which starts JAX; a user's
    # module may run JAX as it is imported). TensorFlow's strategy may wait for its peers:
    # after the config is checked.
    where = placement.make_placement(config) if current.is_jax() else None
    components = resolve_components(config)
    check_model_dir(runtime.model_dir, config)
    if where is None:
        where = placement.make_placement(config)
    exporter = None
    if runtime.metrics_port is not None and where.chief:
        exporter = PrometheusExporter(
            runtime.metrics_port,
            run_name=os.path.basename(os.path.normpath(runtime.model_dir)),
            examples_per_step=config.data.batch_size,
            update_every=config.log_every,
        )
    try:
        with placement.determinism(config.deterministic):
            return _run(config, runtime, where, components, exporter)
    finally:
        if exporter is not None:
            exporter.close()


def _run(
    config: TrainConfig,
    runtime: Runtime,
    where: placement.Placement,
    components: Components,
    exporter: PrometheusExporter | None,
) -> dict[str, Any]:
    chief = where.chief
    model_dir = runtime.model_dir
    # Before the data (a first run prepares it): a bad manifest fails at once.
    manifest_file = PrecisionManifest.from_json(config.manifest) if config.manifest else None
    run_data = components.data()
    placement.check_batches(where, config.data, run_data)

    with placement.scope(where, model_dir):
        run = assemble(config, components, run_data, manifest_file)
        # All checked: the run may claim model_dir.
        prepare_model_dir(model_dir, config, write_config=chief)
        with placement.write_dir(where, model_dir) as write_dir:
            checkpointer = placement.checkpointer(
                model_dir,
                run.model,
                run.optimizer,
                config.keep_checkpoints,
                write_dir,
                {"learning_rate_scale": learning_rate_scale(run.optimizer)},
            )
            step = checkpointer.restore()
            if chief:
                write_json_atomic(
                    os.path.join(model_dir, PRECISION_REPORT_FILE), run.report.to_dict()
                )
            validation = fit_loop.sharded_by_data(
                run_data.eval_batches(config.data.eval_batch_size)
            )
            if step < config.steps:
                state = fit_loop.Fit(
                    model=run.model,
                    manifest=run.manifest,
                    config=config,
                    model_dir=model_dir,
                    verbose=runtime.verbose,
                    callbacks=runtime.callbacks,
                    checkpointer=checkpointer,
                    data=run_data,
                    validation=validation,
                    exporter=exporter,
                )
                fit_loop.fit(state, step)
            else:
                _LOGGER.info("Step %d of %d already done: evaluating only.", step, config.steps)
            metrics = _final_metrics(run.model, validation, components.task, run.report)
            # Every worker saves (saving reads variables collectively); the chief's file counts.
            _save_model_atomic(run.model, os.path.join(write_dir, MODEL_FILE))
            _save_for_users(run.model, write_dir, saved_model=config.saved_model)
    if chief:
        write_json_atomic(os.path.join(model_dir, METRICS_FILE), metrics)
    _LOGGER.info("Final metrics: %s", metrics)
    return metrics


def _save_for_users(model: keras.Model, write_dir: str, *, saved_model: bool) -> None:
    """`serving.keras` (if loadable without mpt_keras) and, if asked, the SavedModel
    (TensorFlow's)."""
    try:
        serving.save_for_serving(model, os.path.join(write_dir, serving.SERVING_MODEL_FILE))
    except serving.NotServableError as error:
        _LOGGER.warning("No %s: %s", serving.SERVING_MODEL_FILE, error)
    if not saved_model:
        return
    if current.is_jax():
        _LOGGER.info("No %s: a SavedModel needs TensorFlow.", serving.SAVED_MODEL_DIR)
        return
    serving.export_saved_model(model, os.path.join(write_dir, serving.SAVED_MODEL_DIR))


def _final_metrics(
    model: keras.Model, validation, task: str | None, report: PrecisionReport
) -> dict[str, Any]:
    results = task_models.evaluate(model, validation, return_dict=True, verbose=0)
    optimizer = model.optimizer
    health = optimizer.health()
    metrics: dict[str, Any] = {
        "step": int(keras.ops.convert_to_numpy(optimizer.iterations)),
        "precision": report.precision,
        "loss_scale": health.loss_scale,
        "skipped_steps": health.skipped_steps,
        "bad_batches": health.bad_batches,
    }
    metrics.update({f"val_{name}": float(value) for name, value in results.items()})
    if task == models.LANGUAGE_MODEL:
        loss = metrics["val_loss"]
        # A diverged run's loss may overflow exp(): its perplexity is inf.
        metrics["val_perplexity"] = math.inf if loss > _LOG_FLOAT_MAX else math.exp(loss)
        metrics["val_bits_per_byte"] = metrics["val_loss"] / math.log(2)
    return metrics


def _save_model_atomic(model: keras.Model, path: str) -> None:
    # Keras insists on the .keras suffix.
    partial = os.path.join(os.path.dirname(path), ".partial." + os.path.basename(path))
    model.save(partial)
    os.replace(partial, path)
