"""A run's fit loop: `model.fit` with our callbacks, and rollbacks on divergence.

Epochs of `checkpoint_every` steps, each checkpointed: a rerun resumes at its exact step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import sys
from typing import Any

import keras

from mpt_keras.backend import current
from mpt_keras.config import TrainConfig
from mpt_keras.data import RunData
from mpt_keras.errors import RunStoppedError
from mpt_keras.files import write_text_atomic
from mpt_keras.keras_bridge import task_models
from mpt_keras.keras_bridge.callbacks import IntervalProgbar, SaveCheckpoints, StopAtStep
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.precision.promote import promote
from mpt_keras.reliability.auto_promote import AutoPromote
from mpt_keras.reliability.guards import BadBatchLimit, Diverged, DivergenceGuard
from mpt_keras.runs.assembly import learning_rate_scale
from mpt_keras.runs.model_dir import LOGS_SUBDIR, METRICS_CSV_FILE, PROMOTED_MANIFEST_FILE
from mpt_keras.runs.precision_plan import build_on_data
from mpt_keras.telemetry.metrics_csv import MetricsCsv
from mpt_keras.telemetry.monitor import MixedPrecisionMonitor
from mpt_keras.telemetry.prometheus import PrometheusExporter

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass
class Fit:
    """The fit loop's state; a promotion replaces the manifest."""

    model: keras.Model
    manifest: PrecisionManifest
    config: TrainConfig
    model_dir: str
    verbose: int | None
    callbacks: tuple[keras.callbacks.Callback, ...]
    checkpointer: Any  # `placement.checkpointer`'s
    data: RunData
    validation: Any  # `sharded_by_data(RunData.eval_batches(...))`
    exporter: PrometheusExporter | None


def fit(state: Fit, step: int) -> None:
    """Trains from `step` to `config.steps`; `RunStoppedError` when a divergence is not mended."""
    divergence = state.config.divergence
    if divergence.patience and step == 0:
        state.checkpointer.save(0)  # Something to roll back to.
    rollbacks = 0
    while True:
        guard = DivergenceGuard(divergence.patience, divergence.max_loss)
        try:
            _fit_from(state, step, guard if divergence.patience else None)
            return
        except Diverged as diverged:
            rollbacks += 1
            if divergence.action == "stop" or rollbacks > divergence.max_rollbacks:
                done = "" if divergence.action == "stop" else f" after {rollbacks - 1} rollbacks"
                raise RunStoppedError(
                    f"training diverged at {diverged}{done}; divergence.action="
                    f"{divergence.action}: stopped, the checkpoints in {state.model_dir} "
                    "are kept (all saved while the loss was healthy)"
                ) from None
            step = state.checkpointer.restore()
            _mend(state, diverged)
            _LOGGER.warning(
                "Training diverged at %s: rolled back to step %d (rollback %d of %d).",
                diverged,
                step,
                rollbacks,
                divergence.max_rollbacks,
            )


def sharded_by_data(dataset: Any) -> Any:
    """Global batches that multi-worker strategies split by data (no files); a JAX run's
    batches as they are."""
    if current.is_jax():
        return dataset
    from mpt_keras.backend.tensorflow import datasets

    return datasets.sharded_by_data(dataset)


def _mend(state: Fit, diverged: Diverged) -> None:
    if state.config.divergence.action == "rollback":
        scale = learning_rate_scale(state.model.optimizer)
        scale.assign(scale * state.config.divergence.lr_factor)
        _LOGGER.warning("Learning rate scaled by %g.", float(keras.ops.convert_to_numpy(scale)))
        return
    state.manifest, promotions = promote(
        state.model,
        state.manifest,
        reason=f"divergence at {diverged}",
        inputs=build_on_data(state.model, state.data),
    )
    if not promotions:
        raise RunStoppedError(
            f"training diverged at {diverged} with every layer in float32 already: "
            "divergence.action=promote has nothing to promote; lower the learning rate"
        )
    write_text_atomic(
        os.path.join(state.model_dir, PROMOTED_MANIFEST_FILE), state.manifest.to_json()
    )
    for promotion in promotions:
        _LOGGER.warning(
            "Layer %s promoted from %s to %s.", promotion.path, promotion.old, promotion.new
        )


def _fit_from(state: Fit, step: int, guard: DivergenceGuard | None) -> None:
    config = state.config
    interval = config.checkpoint_every
    train = sharded_by_data(
        state.data.train_batches(
            config.data.batch_size,
            seed=config.seed,
            start_step=step,
            shuffle_buffer=config.data.shuffle_buffer,
        )
    )
    first_epoch = step // interval
    verbose = state.verbose if state.verbose is not None else (1 if sys.stdout.isatty() else 2)
    _LOGGER.info(
        "Training steps %d..%d in intervals of %d (%s, Keras backend %s).",
        step + 1,
        config.steps,
        interval,
        f"manifest {config.manifest}" if config.manifest else config.precision,
        current.name(),
    )
    task_models.fit(
        state.model,
        train,
        initial_epoch=first_epoch,
        epochs=first_epoch + math.ceil((config.steps - step) / interval),
        steps_per_epoch=interval,
        validation_data=state.validation,
        validation_freq=config.eval_every // interval,
        callbacks=[
            StopAtStep(config.steps),
            *([IntervalProgbar(config.steps)] if verbose else []),
            *([] if guard is None else [guard]),
            BadBatchLimit(config.data.max_bad_batches, check_every=config.log_every),
            MixedPrecisionMonitor(
                os.path.join(state.model_dir, LOGS_SUBDIR),
                update_freq=config.log_every,
                examples_per_step=config.data.batch_size,
                diagnosis_data=functools.partial(_batch_of_step, state),
            ),
            MetricsCsv(os.path.join(state.model_dir, METRICS_CSV_FILE), config.log_every),
            *([] if state.exporter is None else [state.exporter]),
            SaveCheckpoints(state.checkpointer, healthy=None if guard is None else guard.healthy),
            *_auto_promote(state),
            *state.callbacks,
        ],
        shuffle=False,  # The stream is shuffled by the data pipeline, by step.
        verbose=verbose,
    )


def _batch_of_step(state: Fit, step: int) -> tuple[Any, ...]:
    """The global batch of (1-based) `step`: the data is a function of the step."""
    config = state.config
    return state.data.batch_of_step(
        config.data.batch_size, config.seed, step, config.data.shuffle_buffer
    )


def _auto_promote(state: Fit) -> list[AutoPromote]:
    if not state.config.auto_promote:
        return []
    return [
        AutoPromote(
            state.manifest,
            check_every=state.config.log_every,
            manifest_path=os.path.join(state.model_dir, PROMOTED_MANIFEST_FILE),
            log_dir=os.path.join(state.model_dir, LOGS_SUBDIR),
            inputs=build_on_data(state.model, state.data),
        )
    ]
