"""`run_canary`: a few steps on a small subset, stopping a run that diverges early.

The run and float32 train `steps` steps side by side on the first
`CanaryThresholds.examples` examples. The run has diverged, in this order:

    non-finite     a step's loss is NaN or infinite;
    rising         its mean loss of the last max(1, steps // 5) steps exceeds its first
                   step's by > `max_loss_rise` (the recipe is wrong);
    off float32    that mean exceeds float32's by > `max_loss_gap` (the precision is).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras

from mpt_keras.checks import check_number
from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.files import check_writable_dir, json_safe, write_json_atomic
from mpt_keras.runs.side_by_side import resolve_side_by_side, train_steps
from mpt_keras.runs.training import Runtime, run_training

CANARY_FILE = "canary.json"


@dataclasses.dataclass(frozen=True)
class CanaryThresholds:
    """When the canary calls a run diverged (relative rises; see the module doc).

    `max_loss_rise` 10%: small-batch noise lifts a healthy loss a little; `max_loss_gap` 25%:
    far beyond the reference models' 1% in 16 bits.
    """

    max_loss_rise: float = 0.1
    max_loss_gap: float = 0.25
    examples: int = 1024

    def __post_init__(self):
        for name in ("max_loss_rise", "max_loss_gap"):
            check_number(f"canary {name}", getattr(self, name), minimum=0)
        check_number("canary examples", self.examples, minimum=1, integer=True)


@dataclasses.dataclass(frozen=True)
class CanaryResult:
    """The canary's verdict on a precision (or manifest); `message` is one line."""

    precision: str
    steps: int
    losses: tuple[float, ...]
    baseline_losses: tuple[float, ...]
    skipped_steps: int
    diverged: bool
    message: str

    def to_dict(self) -> dict[str, Any]:
        """JSON values (`files.json_safe`)."""
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

    Arguments as `validate`'s (the precision among `config`'s settings).

    Raises:
        UserInputError: For a bad `steps`, config, manifest or dataset.
    """
    config, components, baseline_config = resolve_side_by_side(
        model, steps, data, loss, metrics, config, steps_name="canary steps", source="canary"
    )
    candidate_config = config.merged({"steps": steps}, source="canary")
    # train_steps' final validation need only be cheap here.
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
    """`mpt-train --canary_steps=N`: the canary (into `model_dir/canary.json`), then the run.

    The canary runs before the strategy exists (not with `virtual_cpus`). `UserInputError` if
    the candidate diverged (naming how): the run is not started.
    """
    if config.virtual_cpus:
        raise UserInputError(
            f"canary_steps={steps} with virtual_cpus={config.virtual_cpus}: the canary runs "
            "before the CPU could be split. Allowed: one of them"
        )
    result = run_canary(config, steps, thresholds)
    check_writable_dir(runtime.model_dir, "model_dir")
    write_json_atomic(os.path.join(runtime.model_dir, CANARY_FILE), result.to_dict())
    if result.diverged:
        raise UserInputError(f"canary: {result.message}; the full run was not started")
    return run_training(config, runtime)
