"""Calibration's decision per layer or tied group: a policy, and a reason naming the figures."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from mpt_keras.calibration.sites import Group, pass_through_reason
from mpt_keras.calibration.statistics import ActivationStatistics, LayerGradients, OutputErrors
from mpt_keras.checks import check_number
from mpt_keras.precision.limits import FLOAT16_MAX, FLOAT16_SMALLEST_SUBNORMAL


@dataclasses.dataclass(frozen=True)
class CalibrationThresholds:
    """When a layer may compute in float16 or bfloat16, or a Dense or EinsumDense in float8.

    A layer (or group, on all members' figures) gets `mixed_float16` if its activation max
    <= `FLOAT16_MAX` / `float16_headroom`, float16 flushes <= `max_flushed_norm_fraction` of
    the norm of its activations and of its gradient x initial scale, and its float16 error <=
    `max_float16_error`; else `mixed_bfloat16` if its bfloat16 error <= `max_bfloat16_error`;
    else `float32`.

    Attributes:
        float16_headroom: Unseen batches run larger than the few calibrated.
        max_float16_error: float16's rounding unit is 4.9e-4: 1e-2 allows 20-fold amplification.
        max_float8_saturated_fraction: Of each input, kernel and output gradient at the delayed
            scale (`calibration.float8`): 0.1% allows outliers, refuses a jumping amax.
        min_float8_speedup: A float8 GEMM's speed over the compute dtype's, measured on this
            device (`calibration.float8_speed`): below 1 float8 costs time.

    Raises:
        UserInputError: For a value <= 0, a fraction > 1, a headroom < 1.
    """

    float16_headroom: float = 8.0
    max_flushed_norm_fraction: float = 0.01
    max_float16_error: float = 1e-2
    max_bfloat16_error: float = 5e-2
    max_float8_saturated_fraction: float = 1e-3
    max_float8_underflowed_fraction: float = 1e-2
    min_float8_speedup: float = 1.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            what, value = f"CalibrationThresholds.{field.name}", getattr(self, field.name)
            if field.name == "float16_headroom":
                check_number(what, value, minimum=1)
            else:
                share = field.name.endswith("_fraction")
                check_number(what, value, above=0, maximum=1 if share else None)


class Decision(NamedTuple):
    """A layer's policy, and why."""

    policy: str
    reason: str


@dataclasses.dataclass(frozen=True)
class GroupFigures:
    """All a group's members' figures; `errors` None when not measured."""

    activations: ActivationStatistics
    gradients: LayerGradients
    errors: OutputErrors | None = None


class Decider:
    """Decides groups by `thresholds`; `safe_defaults` (site path -> why) keep a group float32."""

    def __init__(
        self,
        thresholds: CalibrationThresholds,
        initial_scale: float,
        safe_defaults: dict[str, str],
    ):
        self._limits = thresholds
        self._scale = initial_scale
        self._safe_defaults = safe_defaults

    def measured(self, group: Group, figures: GroupFigures, holds_sites: bool) -> Decision:
        """`holds_sites`: the lead is a container."""
        safe_default = self._safe_default(group)
        if safe_default is not None:
            return Decision("float32", safe_default)
        limits = self._limits
        problems = self._range_problems(figures)
        # A block's measurement covers its own ops, its sublayers apart.
        parts = ["own ops"] if holds_sites else []
        tied = [member.path.removeprefix(group.lead.path + "/") for member in group.members[1:]]
        parts += [f"with tied {', '.join(tied)}"] if tied else []
        covered = f"{' '.join(parts)}: " if parts else ""
        float16_error = _nan_as_inf(figures.errors.mixed_float16)
        bfloat16_error = _nan_as_inf(figures.errors.mixed_bfloat16)
        if not problems:
            if float16_error <= limits.max_float16_error:
                return Decision(
                    "mixed_float16",
                    f"{covered}range fits float16, error {float16_error:.2g} <= "
                    f"{limits.max_float16_error:g} -> mixed_float16",
                )
            problems.append(f"float16 error {float16_error:.2g} > {limits.max_float16_error:g}")
        if bfloat16_error <= limits.max_bfloat16_error:
            return Decision("mixed_bfloat16", covered + "; ".join(problems) + " -> mixed_bfloat16")
        return Decision(
            "float32",
            covered
            + "; ".join(problems)
            + f"; bfloat16 error {bfloat16_error:.2g} > {limits.max_bfloat16_error:g} -> float32",
        )

    def unmeasured(self, group: Group, figures: GroupFigures, default: str) -> Decision:
        """The default, unless the group's range rules out a float16 default."""
        safe_default = self._safe_default(group)
        if safe_default is not None:
            return Decision("float32", safe_default)
        why = unmeasured_reason(group)
        problems = self._range_problems(figures)
        if problems and default == "mixed_float16":
            return Decision(
                "mixed_bfloat16", f"{why}; " + "; ".join(problems) + " -> mixed_bfloat16"
            )
        return Decision(default, f"{why} -> the default {default}")

    def _safe_default(self, group: Group) -> str | None:
        for member in group.members:
            if member.path in self._safe_defaults:
                reason = self._safe_defaults[member.path]
                return reason if member is group.lead else f"{reason} (tied {member.path})"
        return None

    def _range_problems(self, figures: GroupFigures) -> list[str]:
        """What rules float16 out: the activations' range, the flushed norms."""
        limits = self._limits
        fits = FLOAT16_MAX / limits.float16_headroom
        flushed_limit = format_share(limits.max_flushed_norm_fraction)
        below = f"below {FLOAT16_SMALLEST_SUBNORMAL:.0e}; > {flushed_limit}"
        problems = []
        if figures.activations.max > fits:
            problems.append(
                f"activation max {figures.activations.max:.3g} > {fits:.0f} "
                f"(float16 max {FLOAT16_MAX:g} / headroom {limits.float16_headroom:g})"
            )
        # nan (a norm not finite in float32: no precision mends it) compares False.
        flushed = figures.activations.flushed_norm_fraction
        if flushed > limits.max_flushed_norm_fraction:
            problems.append(
                f"activations: {format_share(flushed)} of their norm flushes to zero in float16 "
                f"({below})"
            )
        flushed = figures.gradients.flushed_norm_fraction
        if flushed > limits.max_flushed_norm_fraction:
            problems.append(
                f"gradient x {self._scale:g}: {format_share(flushed)} of its norm flushes to "
                f"zero in float16 ({below})"
            )
        return problems


def unmeasured_reason(group: Group) -> str | None:
    """Why a group is not measured (not called, or passes its inputs on), or None."""
    if not group.called.calls:
        return "not called on the calibration batches"
    passes_through = pass_through_reason(group.lead.layer) if len(group.members) == 1 else None
    return f"no compute worth measuring ({passes_through})" if passes_through else None


def tied_reason(lead: str, policy: str) -> str:
    return f"tied to {lead} (they meet in an op of one dtype) -> {policy}"


def format_share(fraction: float) -> str:
    """A share as calibration's reasons write it (`0.0153%`)."""
    return f"{100 * fraction:.3g}%"


def _nan_as_inf(error: float) -> float:
    # nan: the low-precision output was not finite.
    return math.inf if math.isnan(error) else error
