"""What the last train steps left behind: one typed record, read in one sync; no TensorFlow.

`LossScaleOptimizer.health()` fills it; readers (monitor, guards, final metrics) read the
record, not the variables one by one.
"""

from __future__ import annotations

import dataclasses
import math

# How many of the latest bad batches' steps the record keeps.
BAD_BATCH_MEMORY = 64

# The keys `LossScaleOptimizer.step_logs` adds to every train step's logs (and telemetry's tags).
LOSS_SCALE = "loss_scale"
SKIPPED_STEPS = "skipped_steps"
BAD_BATCHES = "bad_batches"
GRADIENT_NORM = "gradient_norm"
# Float8 models only.
FLOAT8_RANGE_USED = "float8_range_used"


@dataclasses.dataclass(frozen=True)
class StepHealth:
    """The loss-scaling state after the last step, as `LossScaleOptimizer`'s properties.

    `bad_batch_steps`: the inner `iterations` after each of the latest `BAD_BATCH_MEMORY` bad
    batches, oldest first. `last_loss` is 0 before a finite batch; `gradient_norm` is inf or
    NaN after an overflow.
    """

    loss_scale: float
    skipped_steps: int
    bad_batches: int
    bad_batch_steps: tuple[int, ...]
    last_loss: float
    gradient_norm: float
    nonfinite_counts: dict[str, int]

    @property
    def last_step_finite(self) -> bool:
        """Whether the last step's gradients were finite."""
        return math.isfinite(self.gradient_norm)
