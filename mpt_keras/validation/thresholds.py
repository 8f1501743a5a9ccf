"""What a mixed-precision candidate must meet against float32: thresholds and checks.

The numbers `validate` (in `mpt_keras.runs.validation`) compares, kept free of
TensorFlow so that `mpt-validate` shows its flags' defaults and rejects a bad
value at once.
"""

from __future__ import annotations

import dataclasses

from mpt_keras.errors import UserInputError

BASELINE = "float32"
DEFAULT_STEPS = 50


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """What the candidate must meet against the float32 baseline.

    The defaults pass `mixed_bfloat16` and `mixed_float16` (with the safe
    defaults) on the reference models with a wide margin: their output
    relative errors measure 0.0002 to 0.0032 (50 steps, 2026-11-24), the
    bundled Transformer's float8 manifest 0.0088.

    Attributes:
        output_rtol: Largest relative error of any model output. bfloat16 keeps
            8 significant bits (a rounding of up to 0.4%) and a few such
            roundings add up through the layers: 5%.
        min_top1_agreement: Smallest fraction of predictions whose argmax
            agrees with float32.
        max_kl: Largest mean KL divergence of the output softmax, in nats.
        max_metric_delta: Largest drop of the final validation accuracy
            against float32 (0.03: three points).
        max_loss_gap: Largest relative gap of the final training loss.
        max_skipped_fraction: Largest fraction of the candidate's training
            steps skipped for non-finite gradients.

    Example:

        Thresholds(output_rtol=0.01, max_metric_delta=0.0)
    """

    output_rtol: float = 0.05
    min_top1_agreement: float = 0.95
    max_kl: float = 0.01
    max_metric_delta: float = 0.03
    max_loss_gap: float = 0.1
    max_skipped_fraction: float = 0.1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise UserInputError(
                    f"threshold {field.name}: must be a number >= 0, received {value!r}"
                )
        if self.min_top1_agreement > 1:
            raise UserInputError(
                "threshold min_top1_agreement: must be in [0, 1], "
                f"received {self.min_top1_agreement!r}"
            )


@dataclasses.dataclass(frozen=True)
class Check:
    """One verdict: `value` against `threshold` (`<=` or `>=`).

    Example:

        Check("output_relative_error", 0.004, 0.05, "<=").passed  # True
    """

    name: str
    value: float
    threshold: float
    comparison: str

    @property
    def passed(self) -> bool:
        """Whether the value meets the threshold; a NaN value never does."""
        if self.comparison == "<=":
            return self.value <= self.threshold
        return self.value >= self.threshold

    def describe(self) -> str:
        """One line: `name: value (allowed comparison threshold) PASS|FAIL`."""
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{self.name}: {self.value:.6g} (allowed {self.comparison} {self.threshold:.6g}) "
            f"{verdict}"
        )
