"""ValidationReport: `validate`'s result, which `mpt-validate` prints and writes as JSON."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from mpt_keras.files import json_safe
from mpt_keras.tables import aligned
from mpt_keras.validation.forward_parity import LayerParity, nan_as_inf
from mpt_keras.validation.parity_rows import UnreachedLayer
from mpt_keras.validation.thresholds import BASELINE, Check


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    """The comparison of a candidate (precision or manifest path) with float32."""

    candidate: str
    steps: int
    layers: tuple[LayerParity, ...]
    outputs: tuple[LayerParity, ...]
    baseline_losses: tuple[float, ...]
    candidate_losses: tuple[float, ...]
    baseline_metrics: Mapping[str, float]
    candidate_metrics: Mapping[str, float]
    skipped_steps: int
    checks: tuple[Check, ...]
    unreached: tuple[UnreachedLayer, ...] = ()

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def failed_checks(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]

    def drift_entry(self) -> str:
        """The leaf row with the largest error jump ("" if none); a block's jump sums its
        sublayers' drift."""
        paths = [layer.path for layer in self.layers]
        leaves = [
            layer
            for layer in self.layers
            if not any(path.startswith(layer.path + "/") for path in paths)
        ]
        entry = max(leaves, key=lambda layer: nan_as_inf(layer.error_jump), default=None)
        return entry.path if entry else ""

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON values (NaN and inf as strings: `files.json_safe`)."""
        values = dataclasses.asdict(self)
        values["checks"] = [
            {**dataclasses.asdict(check), "passed": check.passed} for check in self.checks
        ]
        values["passed"] = self.passed
        values["drift_entry"] = self.drift_entry()
        return json_safe(values)

    def __str__(self) -> str:
        """The table (`print(report)`); `repr` keeps every field."""
        return self.table()

    def table(self) -> str:
        lines = [f"candidate {self.candidate} vs {BASELINE}: {'PASS' if self.passed else 'FAIL'}"]
        lines += ["", "checks:"] + [f"  {check.describe()}" for check in self.checks]
        columns = ("path", "compute", "max_abs", "mean_abs", "relative", "jump")
        rows = [columns] + [
            (
                layer.path,
                layer.compute_dtype,
                *(
                    f"{value:.3g}"
                    for value in (
                        layer.max_abs_error,
                        layer.mean_abs_error,
                        layer.relative_error,
                        layer.error_jump,
                    )
                ),
            )
            for layer in self.layers
        ]
        lines += ["", f"forward parity per layer (drift enters at {self.drift_entry()}):"]
        lines += aligned(rows, indent="  ")
        for output in self.outputs:
            lines.append(
                f"output {output.path}: top1_agreement {output.top1_agreement:.4f}, "
                f"kl_divergence {output.kl_divergence:.3g}"
            )
        if self.unreached:
            lines += ["", f"not compared ({len(self.unreached)}):"]
            lines += [f"  {layer.path}: {layer.reason}" for layer in self.unreached]
        lines += ["", f"training parity over {self.steps} steps:"]
        metric_names = sorted(self.baseline_metrics, key=lambda name: name != "val_loss")
        lines += aligned(
            [("", "loss first", "loss last", *metric_names)]
            + [
                (
                    name,
                    f"{losses[0]:.4f}",
                    f"{losses[-1]:.4f}",
                    *(f"{metrics.get(metric, math.nan):.4f}" for metric in metric_names),
                )
                for name, losses, metrics in (
                    (BASELINE, self.baseline_losses, self.baseline_metrics),
                    (self.candidate, self.candidate_losses, self.candidate_metrics),
                )
            ],
            indent="  ",
        )
        lines.append(f"candidate skipped steps: {self.skipped_steps}")
        return "\n".join(lines) + "\n"
