"""Config sections for how a run learns: the inner optimizer, what a divergence does
(`loss_scale` is `scaling.settings.LossScaleSettings` itself)."""

from __future__ import annotations

import dataclasses
import math

from mpt_keras.config import key_checks as check
from mpt_keras.config.names import DIVERGENCE_ACTIONS, LR_SCHEDULES, OPTIMIZERS


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The inner optimizer that the loss-scale optimizer wraps.

    `learning_rate` is the peak: `cosine` decays it to zero after `warmup_steps` of linear
    warm-up; `weight_decay` is `adamw`'s.
    """

    name: str = "adam"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    global_clipnorm: float | None = None

    def __post_init__(self):
        check.choice("optimizer.name", self.name, OPTIMIZERS)
        check.choice("optimizer.schedule", self.schedule, LR_SCHEDULES)
        check.number("optimizer.learning_rate", self.learning_rate, above=0)
        check.number("optimizer.weight_decay", self.weight_decay, minimum=0)
        check.number("optimizer.warmup_steps", self.warmup_steps, minimum=0, integer=True)
        check.require(
            self.global_clipnorm is None or self.global_clipnorm > 0,
            "optimizer.global_clipnorm",
            "null or a number > 0",
            self.global_clipnorm,
        )
        check.require(
            self.weight_decay == 0 or self.name == "adamw",
            "optimizer.weight_decay",
            "0 unless optimizer.name is 'adamw'",
            self.weight_decay,
        )


@dataclasses.dataclass(frozen=True)
class DivergenceConfig:
    """When a run counts as diverged, and what it does then.

    Attributes:
        patience: Consecutive steps with a non-finite (or > `max_loss`) loss that make the
            run diverged; 0: never.
        action: From the last checkpoint, `rollback` at learning rate x `lr_factor`, `promote`
            each layer a step (float16 -> bfloat16 -> float32); `stop` raises.
        max_rollbacks: Rollbacks (or promotions) after which the run stops.
    """

    patience: int = 0
    max_loss: float | None = None
    action: str = "rollback"
    lr_factor: float = 0.5
    max_rollbacks: int = 3

    def __post_init__(self):
        check.choice("divergence.action", self.action, DIVERGENCE_ACTIONS)
        check.number("divergence.patience", self.patience, minimum=0, integer=True)
        check.require(
            self.max_loss is None or math.isfinite(self.max_loss),
            "divergence.max_loss",
            "null or a finite number",
            self.max_loss,
        )
        check.require(
            0 < self.lr_factor < 1, "divergence.lr_factor", "a number > 0 and < 1", self.lr_factor
        )
        check.number("divergence.max_rollbacks", self.max_rollbacks, minimum=0, integer=True)
