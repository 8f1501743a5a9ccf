"""What `calibrate` returns: typed statistics, their JSON (`files.json_safe`) and table, the
manifest."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from mpt_keras.calibration.decisions import CalibrationThresholds, Decision, format_share
from mpt_keras.calibration.float8 import Float8Layer
from mpt_keras.calibration.statistics import (
    ActivationStatistics,
    LayerGradients,
    OutputErrors,
    VariableGradients,
)
from mpt_keras.files import json_safe
from mpt_keras.precision.float8 import QUANTIZED_TENSORS
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.tables import aligned

_COLUMNS = ("path", "class", "act_max", "fp16_err", "bf16_err", "policy", "reason")
_FLOAT8_COLUMNS = (
    "path", "class", "in_amax", "in_sat", "in_under", "k_amax", "k_under",
    "g_amax", "g_sat", "g_under", "policy", "reason",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LayerStatistics:
    """A layer's figures and decision; `errors` None when not measured alone."""

    class_name: str
    activations: ActivationStatistics
    gradients: LayerGradients
    errors: OutputErrors | None
    decision: Decision

    def to_json(self) -> dict[str, Any]:
        return {
            "class": self.class_name,
            "activations": self.activations.to_json(),
            "gradients": self.gradients.to_json(),
            "errors": None if self.errors is None else self.errors.to_json(),
            "policy": self.decision.policy,
            "reason": self.decision.reason,
        }


@dataclasses.dataclass(frozen=True)
class CalibrationStatistics:
    """All one `calibrate` call measured and decided; `float8`: rules asked for.

    `diagnosis`: where the first batch with non-finite gradients stopped being finite, or None.
    """

    model: str
    steps: int
    seed: int
    initial_scale: float
    thresholds: CalibrationThresholds
    default: str
    layers: dict[str, LayerStatistics]
    gradients: dict[str, VariableGradients]
    diagnosis: str | None
    float8: bool
    float8_layers: dict[str, Float8Layer]

    def to_json(self) -> dict[str, Any]:
        return json_safe(
            {
                "model": self.model,
                "steps": self.steps,
                "seed": self.seed,
                "initial_scale": self.initial_scale,
                "thresholds": dataclasses.asdict(self.thresholds),
                "default": self.default,
                "layers": {path: layer.to_json() for path, layer in self.layers.items()},
                "gradients": {path: grad.to_json() for path, grad in self.gradients.items()},
                "diagnosis": self.diagnosis,
                "float8": self.float8,
                "float8_layers": {
                    path: layer.to_json() for path, layer in self.float8_layers.items()
                },
            }
        )


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    """`statistics`: `CalibrationStatistics.to_json` (`layers`, `float8_layers` by layer path,
    `gradients` by variable path; non-finite as `"inf"`, `"-inf"`, `"nan"`); `manifest`: the
    decided manifest, a reason on every rule."""

    statistics: dict[str, Any]
    manifest: PrecisionManifest

    def to_json(self) -> str:
        return json.dumps(self.statistics, indent=2, allow_nan=False) + "\n"

    def table(self) -> str:
        """A row per layer and what decided its policy (`format_calibration_table`)."""
        return format_calibration_table(self.statistics)

    def __str__(self) -> str:
        """The table (`print(result)`); `repr` keeps every field."""
        return self.table()


def format_calibration_table(statistics: dict[str, Any]) -> str:
    """`CalibrationResult.statistics` as a table: a row per layer; if float8 rules were asked
    for, a blank line and a row per Dense/EinsumDense; the `diagnosis`, if any."""
    rows = [_COLUMNS]
    for path, layer in statistics["layers"].items():
        errors = layer["errors"]  # None: not measured alone.
        rows.append(
            (
                path,
                layer["class"],
                format_figure(layer["activations"]["max"]),
                format_figure(errors["mixed_float16"]) if errors else "-",
                format_figure(errors["mixed_bfloat16"]) if errors else "-",
                layer["policy"],
                layer["reason"],
            )
        )
    lines = aligned(rows)
    if statistics.get("float8") and statistics["float8_layers"]:
        lines += ["", *aligned([_FLOAT8_COLUMNS, *_float8_rows(statistics["float8_layers"])])]
    if statistics.get("diagnosis"):
        lines.append(statistics["diagnosis"])
    return "\n".join(lines) + "\n"


def format_figure(value: float | str) -> str:
    """A figure (float or JSON string) as tables write it: `4.34`, or `nonfinite`."""
    number = float(value)
    return f"{number:.3g}" if math.isfinite(number) else "nonfinite"


def _float8_rows(float8_layers: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    # The kernel, at its own scale, never saturates.
    rows = []
    for path, layer in float8_layers.items():
        inputs, kernel, gradient = (layer[tensor] for tensor in QUANTIZED_TENSORS)
        rows.append(
            (
                path,
                layer["class"],
                format_figure(inputs["amax"]),
                _share(inputs["saturated"]),
                _share(inputs["underflowed"]),
                format_figure(kernel["amax"]),
                _share(kernel["underflowed"]),
                format_figure(gradient["amax"]),
                _share(gradient["saturated"]),
                _share(gradient["underflowed"]),
                layer["policy"],
                layer["reason"],
            )
        )
    return rows


def _share(fraction: float | str) -> str:
    number = float(fraction)
    return format_share(number) if math.isfinite(number) else "nonfinite"
