"""Calibration's figures per layer and variable, from its float32 pass.

`to_json` gives the statistics JSON's form; non-finite figures stay floats.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from mpt_keras.precision.limits import (
    FLOAT16_MAX,
    FLOAT16_SMALLEST_NORMAL,
    FLOAT16_SMALLEST_SUBNORMAL,
)

_QUANTILES = {"p99": 0.99, "p99_9": 0.999, "p99_99": 0.9999}
_JSON_NAMES = {"p99_9": "p99.9", "p99_99": "p99.99"}


@dataclasses.dataclass(frozen=True)
class ActivationStatistics:
    """|output| of a layer over all its calls and batches.

    `_fraction`s: of non-zero values, those above `FLOAT16_MAX` or below the smallest normal or
    subnormal; `flushed_norm_fraction`: ||flushed|| / ||y|| (nan if ||y|| is not finite).
    """

    max: float
    p99: float
    p99_9: float
    p99_99: float
    above_float16_max_fraction: float
    below_normal_fraction: float
    below_subnormal_fraction: float
    flushed_norm_fraction: float

    def to_json(self) -> dict[str, float]:
        return {_JSON_NAMES.get(name, name): value for name, value in vars(self).items()}


@dataclasses.dataclass(frozen=True)
class LayerGradients:
    """A layer's variables' gradients together: the norm, and the fraction float16 flushes at
    the initial loss scale (nan if the norm is not finite)."""

    norm: float
    flushed_norm_fraction: float

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class VariableGradients:
    """A variable's gradient g over all batches (flushing and overflow of g x initial scale).

    `layer`: its innermost measured layer's path, or None. `overflow_fraction`: non-zero
    entries above `FLOAT16_MAX` scaled; recorded only, as the dynamic scale backs off.
    """

    layer: str | None
    max: float
    norm: float
    flushed_norm_fraction: float
    nonzero_fraction: float
    overflow_fraction: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class OutputErrors:
    """||y_low - y|| / ||y|| of a layer (or group) alone in each low precision, the rest
    float32; inf or nan when y_low is not finite."""

    mixed_float16: float
    mixed_bfloat16: float

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def magnitudes(outputs: list[np.ndarray]) -> np.ndarray:
    """|values| of all `outputs`, flat."""
    return np.concatenate([np.abs(output) for output in outputs] or [np.zeros(0, np.float32)])


def activation_statistics(magnitudes: np.ndarray) -> ActivationStatistics:
    nonzero = magnitudes[magnitudes > 0]

    def share(mask: np.ndarray) -> float:
        return _fraction(np.count_nonzero(mask), nonzero.size)

    quantiles = {
        name: float(np.quantile(magnitudes, quantile)) if magnitudes.size else 0.0
        for name, quantile in _QUANTILES.items()
    }
    return ActivationStatistics(
        max=float(magnitudes.max()) if magnitudes.size else 0.0,
        **quantiles,
        above_float16_max_fraction=share(nonzero > FLOAT16_MAX),
        below_normal_fraction=share(nonzero < FLOAT16_SMALLEST_NORMAL),
        below_subnormal_fraction=share(nonzero < FLOAT16_SMALLEST_SUBNORMAL),
        flushed_norm_fraction=_flushed_norm_fraction(magnitudes, magnitudes),
    )


def variable_gradients(
    layer: str | None, magnitudes: np.ndarray, scale: float
) -> VariableGradients:
    """The figures of a gradient, from its |entries| over all batches."""
    values = magnitudes.astype(np.float64)
    scaled = values * scale
    nonzero = int(np.count_nonzero(values))
    return VariableGradients(
        layer=layer,
        max=float(values.max()) if values.size else 0.0,
        norm=_norm(values),
        flushed_norm_fraction=_flushed_norm_fraction(values, scaled),
        nonzero_fraction=_fraction(nonzero, values.size),
        overflow_fraction=_fraction(int(np.count_nonzero(scaled > FLOAT16_MAX)), nonzero),
    )


def layer_gradients(variables: Iterable[VariableGradients]) -> LayerGradients:
    squared_norm = squared_flushed = 0.0
    for figures in variables:
        squared_norm += figures.norm**2
        squared_flushed += (figures.norm * figures.flushed_norm_fraction) ** 2
    if not math.isfinite(squared_norm + squared_flushed):
        return LayerGradients(math.sqrt(squared_norm), math.nan)
    fraction = math.sqrt(squared_flushed / squared_norm) if squared_norm else 0.0
    return LayerGradients(math.sqrt(squared_norm), fraction)


def _flushed_norm_fraction(values: np.ndarray, scaled: np.ndarray) -> float:
    """||values whose scaled value float16 flushes to zero|| / ||values||."""
    norm = _norm(values)
    if not math.isfinite(norm):
        return math.nan
    return _norm(values[scaled < FLOAT16_SMALLEST_SUBNORMAL]) / norm if norm else 0.0


def _norm(values: np.ndarray) -> float:
    return float(np.sqrt(np.sum(np.square(values, dtype=np.float64))))


def _fraction(count: int, total: int) -> float:
    return count / total if total else 0.0
