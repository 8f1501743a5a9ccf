"""What the last train steps left behind: one typed record, read in one sync.

The loss-scale optimizer keeps the step's health in its own variables (so
checkpoints and `model.save` carry it); `LossScaleOptimizer.health()` reads
them into a `StepHealth`. The monitor, the guards, the final metrics and the
tests read that record, not the optimizer's variables one by one. Imports no
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math

# How many of the latest bad batches' steps the record keeps.
BAD_BATCH_MEMORY = 64

# The entries `LossScaleOptimizer.step_logs` adds to the Keras logs of every
# train step; the telemetry writes them under the same tags.
LOSS_SCALE = "loss_scale"
SKIPPED_STEPS = "skipped_steps"
BAD_BATCHES = "bad_batches"
GRADIENT_NORM = "gradient_norm"
# Only for a model with float8 layers: the largest range used of any float8 tensor.
FLOAT8_RANGE_USED = "float8_range_used"


@dataclasses.dataclass(frozen=True)
class StepHealth:
    """The loss-scaling state after the last step.

    Attributes:
        loss_scale: The current loss scale.
        skipped_steps: Steps (micro-batches) skipped so far: a non-finite
            gradient or update, or a bad batch.
        bad_batches: Steps skipped because their loss or batch held a NaN or
            Inf.
        bad_batch_steps: The steps (1-based, the inner optimizer's
            `iterations` after them) of the latest `BAD_BATCH_MEMORY` bad
            batches, oldest first.
        last_loss: The loss of the last step whose batch was finite, summed
            over replicas (0 before any step that handed its loss over).
        gradient_norm: The global norm of the last step's unscaled gradients,
            before clipping; inf or NaN when the step overflowed.
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
