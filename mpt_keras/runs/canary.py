"""`run_canary`: a few steps on a small subset, to stop a run that diverges early.

Before a long run, the canary trains the run's model `steps` steps on the first
`CanaryThresholds.examples` training examples, in the run's precision (its
`precision` or `manifest`) and in float32, from the same weights and batch
order, with exactly the run `mpt-train` assembles (`validation.train_steps`).
The run is a `TrainConfig` or the user's own model, data and loss (as
`validate` takes them). The candidate has diverged when:

    non-finite     a step's loss is NaN or infinite;
    rising         its loss over the last max(1, steps // 5) steps averages
                   more than `max_loss_rise` above its first step's loss
                   (relative): training goes the wrong way, whatever float32
                   does, as with a learning rate far too large;
    off float32    that average is more than `max_loss_gap` above float32's
                   (relative): the precision, not the recipe, is at fault.

Example:

    result = run_canary(config, steps=20)
    if result.diverged:
        raise UserInputError(result.message)
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras

from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.files import json_safe, write_json_atomic
from mpt_keras.runs import assembly as runs
from mpt_keras.runs.training import Runtime, run_training
from mpt_keras.runs.validation import BASELINE, train_steps

CANARY_FILE = "canary.json"


@dataclasses.dataclass(frozen=True)
class CanaryThresholds:
    """When the canary calls a run diverged; see the module doc.

    Attributes:
        max_loss_rise: Largest rise of the final loss over the first step's,
            relative. A healthy run's loss falls in a few steps; noise on a
            small batch can lift it a little (0.1: 10%).
        max_loss_gap: Largest excess of the final loss over float32's,
            relative (0.25: 25%, far beyond the 1% the reference models show
            in `mixed_bfloat16` and `mixed_float16`).
        examples: Training examples the canary draws its batches from.

    Example:

        CanaryThresholds(max_loss_gap=0.1)
    """

    max_loss_rise: float = 0.1
    max_loss_gap: float = 0.25
    examples: int = 1024

    def __post_init__(self):
        for name in ("max_loss_rise", "max_loss_gap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise UserInputError(f"canary {name}: must be a number >= 0, received {value!r}")
        if (
            isinstance(self.examples, bool)
            or not isinstance(self.examples, int)
            or self.examples < 1
        ):
            raise UserInputError(
                f"canary examples: must be an integer >= 1, received {self.examples!r}"
            )


@dataclasses.dataclass(frozen=True)
class CanaryResult:
    """The canary's verdict on a run's precision.

    Attributes:
        precision: The run's precision, or its manifest's path.
        steps: Steps each model trained.
        losses: The candidate's loss of each step.
        baseline_losses: float32's loss of each step.
        skipped_steps: Candidate steps skipped for non-finite gradients.
        diverged: Whether the candidate diverged.
        message: One line: the verdict and the figures behind it.

    Example:

        result = run_canary(config, steps=20)
        result.diverged, result.message
    """

    precision: str
    steps: int
    losses: tuple[float, ...]
    baseline_losses: tuple[float, ...]
    skipped_steps: int
    diverged: bool
    message: str

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON values (a non-finite loss as a string: `files.json_safe`)."""
        return json_safe(dataclasses.asdict(self))


def run_canary(
    model: TrainConfig | keras.Model | Callable[[], keras.Model],
    steps: int,
    thresholds: CanaryThresholds = CanaryThresholds(),
    *,
    data: tuple[Any, Any] | None = None,
    loss: Any = None,
    metrics: Sequence[Any] = (),
    config: TrainConfig | None = None,
) -> CanaryResult:
    """Trains `steps` steps in the run's precision and in float32; judges divergence.

    Args:
        model: The run config, or the user's own model factory (or functional
            model) with `data`, `loss` and `metrics` as `validate` takes them.
        steps: Canary steps of each model.
        thresholds: When the run counts as diverged.
        data: With a model: `(train, eval)` data.
        loss: With a model: its Keras loss.
        metrics: With a model: its Keras metrics.
        config: With a model: the settings, the precision (or manifest) among
            them; default `TrainConfig()`'s.

    Returns:
        The verdict; `message` says why when `diverged`.

    Raises:
        UserInputError: For a bad `steps`, config, manifest or dataset.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserInputError(f"canary steps: must be an integer >= 1, received {steps!r}")
    config, components = runs.resolve(model, data=data, loss=loss, metrics=metrics, config=config)
    candidate_config = config.merged({"steps": steps}, source="canary")
    baseline_config = config.merged(
        {"precision": BASELINE, "manifest": None, "steps": steps}, source="canary"
    )
    # The final validation of train_steps only needs to be cheap here.
    run_data = components.data().subset(thresholds.examples, config.data.eval_batch_size)
    candidate = train_steps(candidate_config, components, run_data)
    baseline = train_steps(baseline_config, components, run_data)

    precision = config.manifest or config.precision
    diverged, verdict = _verdict(candidate.losses, baseline.losses, thresholds)
    return CanaryResult(
        precision=precision,
        steps=steps,
        losses=candidate.losses,
        baseline_losses=baseline.losses,
        skipped_steps=candidate.skipped_steps,
        diverged=diverged,
        message=f"canary of {precision} over {steps} steps: {verdict}",
    )


def _verdict(
    losses: tuple[float, ...], baseline_losses: tuple[float, ...], thresholds: CanaryThresholds
) -> tuple[bool, str]:
    """Whether the candidate diverged, and why, in the module doc's order."""
    for step, loss in enumerate(losses, start=1):
        if not math.isfinite(loss):
            return True, f"diverged: the loss is {loss} at step {step}"
    window = max(1, len(losses) // 5)
    final = sum(losses[-window:]) / window
    baseline_final = sum(baseline_losses[-window:]) / window
    if final > losses[0] * (1 + thresholds.max_loss_rise):
        return True, (
            f"diverged: the loss rose from {losses[0]:.4g} to {final:.4g} "
            f"(allowed: at most {thresholds.max_loss_rise:.0%} above the first step's)"
        )
    if final > baseline_final * (1 + thresholds.max_loss_gap):
        return True, (
            f"diverged: the loss is {final:.4g} against float32's {baseline_final:.4g} "
            f"(allowed: at most {thresholds.max_loss_gap:.0%} above)"
        )
    return False, (
        f"healthy: the loss went from {losses[0]:.4g} to {final:.4g} "
        f"(float32: {baseline_final:.4g})"
    )


def train_with_canary(
    config: TrainConfig,
    runtime: Runtime,
    steps: int,
    thresholds: CanaryThresholds = CanaryThresholds(),
) -> dict[str, Any]:
    """Runs the canary, records it in `model_dir/canary.json`, then the full run.

    This is `mpt-train --canary_steps=N`. The canary runs before the run's
    strategy exists, so it cannot be combined with `virtual_cpus`.

    Raises:
        UserInputError: If the candidate diverged (naming how); the full run
            is then not started.
    """
    if config.virtual_cpus:
        raise UserInputError(
            f"canary_steps={steps} with virtual_cpus={config.virtual_cpus}: the canary runs "
            "before the CPU could be split. Allowed: one of them"
        )
    result = run_canary(config, steps, thresholds)
    os.makedirs(runtime.model_dir, exist_ok=True)
    write_json_atomic(os.path.join(runtime.model_dir, CANARY_FILE), result.to_dict())
    if result.diverged:
        raise UserInputError(f"canary: {result.message}; the full run was not started")
    return run_training(config, runtime)
