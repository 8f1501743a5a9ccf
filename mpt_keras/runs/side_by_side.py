"""A candidate and float32 trained side by side, a few steps each, writing nothing:
`mpt-train`'s run on the same batches, as `validate` and the canary measure it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras

from mpt_keras.checks import check_number
from mpt_keras.config import TrainConfig
from mpt_keras.data import RunData
from mpt_keras.keras_bridge import task_models
from mpt_keras.runs.assembly import assemble
from mpt_keras.runs.resolution import Components, resolve
from mpt_keras.validation.thresholds import BASELINE


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """`train_steps`' result: each step's loss, the final `val_` metrics, the model."""

    losses: tuple[float, ...]
    metrics: dict[str, float]
    skipped_steps: int
    model: keras.Model


def resolve_side_by_side(
    model: TrainConfig | keras.Model | Callable[[], keras.Model],
    steps: int,
    data: tuple[Any, Any] | None,
    loss: Any,
    metrics: Sequence[Any],
    config: TrainConfig | None,
    *,
    steps_name: str,
    source: str,
) -> tuple[TrainConfig, Components, TrainConfig]:
    """The run's config and components (`resolution.resolve`), and float32's config.

    `steps_name`, `source`: how messages name `steps` and float32's config.
    """
    check_number(steps_name, steps, minimum=1, integer=True)
    config, components = resolve(model, data=data, loss=loss, metrics=metrics, config=config)
    baseline = config.merged(
        {"precision": BASELINE, "manifest": None, "steps": steps}, source=source
    )
    return config, components, baseline


def train_steps(config: TrainConfig, components: Components, run_data: RunData) -> TrainingRun:
    """Trains `config.steps` steps of `mpt-train`'s run on the current strategy."""
    run = assemble(config, components, run_data)
    train = run_data.train_batches(
        config.data.batch_size, config.seed, shuffle_buffer=config.data.shuffle_buffer
    )
    # One step per Keras epoch: the logged loss is that step's, not a running mean.
    history = task_models.fit(
        run.model, train, epochs=config.steps, steps_per_epoch=1, shuffle=False, verbose=0
    )
    validation = run_data.eval_batches(config.data.eval_batch_size)
    metrics = task_models.evaluate(run.model, validation, return_dict=True, verbose=0)
    return TrainingRun(
        losses=tuple(float(loss) for loss in history.history["loss"]),
        metrics={f"val_{name}": float(value) for name, value in metrics.items()},
        skipped_steps=int(run.optimizer.skipped_steps),
        model=run.model,
    )
