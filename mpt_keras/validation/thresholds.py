"""What a mixed-precision candidate must meet against float32: thresholds and checks. Free of
TensorFlow, so `mpt-validate` shows its defaults and refuses a bad value at once.
"""

from __future__ import annotations

import dataclasses

from mpt_keras.checks import check_number

BASELINE = "float32"
DEFAULT_STEPS = 50


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """What the candidate must meet against the float32 baseline (`validate`'s checks).

    The defaults pass `mixed_bfloat16` and `mixed_float16` on the reference models widely
    (output relative errors 0.0002-0.0032; the float8 manifest 0.0088). `output_rtol` 5%:
    bfloat16 rounds by up to 0.4%, adding up through layers. `max_kl` in nats.
    """

    output_rtol: float = 0.05
    min_top1_agreement: float = 0.95
    max_kl: float = 0.01
    max_metric_delta: float = 0.03
    max_loss_gap: float = 0.1
    max_skipped_fraction: float = 0.1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            fraction = field.name == "min_top1_agreement"
            check_number(
                f"threshold {field.name}",
                getattr(self, field.name),
                minimum=0,
                maximum=1 if fraction else None,
                unbounded=not fraction,  # inf: that check never fails
            )


@dataclasses.dataclass(frozen=True)
class Check:
    """One verdict: `value` against `threshold` (`<=` or `>=`)."""

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
