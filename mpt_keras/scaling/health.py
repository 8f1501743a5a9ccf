"""What the last train steps left behind: one typed record, read in one sync; no TensorFlow.

`LossScaleOptimizer.health()` fills it from the optimizer's variables; its readers
(monitor, guards, final metrics) read the record, not the variables one by one.
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
    """The loss-scaling state after the last step.

    Attributes:
        skipped_steps: Steps (micro-batches) skipped: a non-finite gradient or
            update, or a bad batch (a NaN or Inf in its loss or batch).
        bad_batch_steps: The steps (the inner `iterations` after them) of the
            latest `BAD_BATCH_MEMORY` bad batches, oldest first.
        last_loss: The loss, summed over replicas, of the last step with a
            finite batch (0 before any).
        gradient_norm: The last step's unscaled global norm, before clipping;
            inf or NaN after an overflow.
        nonfinite_counts: Per variable path, the steps whose gradient or
            update was non-finite.
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
