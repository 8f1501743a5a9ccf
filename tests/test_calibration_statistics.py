"""Tests of mpt_keras.calibration.statistics: the figures of activations and gradients."""

import math

import numpy as np
import pytest

from mpt_keras.calibration.statistics import (
    VariableGradients,
    activation_statistics,
    layer_gradients,
    magnitudes,
    variable_gradients,
)
from mpt_keras.precision.limits import FLOAT16_MAX, FLOAT16_SMALLEST_SUBNORMAL


def test_activation_fractions_count_the_nonzero_values_beyond_the_float16_limits():
    values = magnitudes([np.array([0.0, 1e5, 1e-5, 1e-8, 1.0], "float32")])
    figures = activation_statistics(values)

    assert figures.max == pytest.approx(1e5)
    assert figures.above_float16_max_fraction == 0.25  # Of the 4 non-zero values.
    assert figures.below_normal_fraction == 0.5
    assert figures.below_subnormal_fraction == 0.25
    assert figures.flushed_norm_fraction == pytest.approx(1e-8 / np.linalg.norm(values))
    assert list(figures.to_json()) == [
        "max", "p99", "p99.9", "p99.99", "above_float16_max_fraction",
        "below_normal_fraction", "below_subnormal_fraction", "flushed_norm_fraction",
    ]  # fmt: skip


def test_no_values_give_zeros():
    figures = activation_statistics(magnitudes([]))
    assert set(figures.to_json().values()) == {0.0}


def test_gradient_flushing_and_overflow_are_of_the_scaled_values():
    scale = 2.0**15
    tiny = FLOAT16_SMALLEST_SUBNORMAL / scale / 2  # Flushed once scaled.
    huge = FLOAT16_MAX / scale * 2  # Overflows once scaled.
    figures = variable_gradients("dense", np.array([0.0, tiny, 1.0, huge]), scale)

    assert figures == VariableGradients(
        layer="dense",
        max=huge,
        norm=pytest.approx(math.hypot(tiny, 1.0, huge)),
        flushed_norm_fraction=pytest.approx(tiny / math.hypot(tiny, 1.0, huge)),
        nonzero_fraction=0.75,
        overflow_fraction=pytest.approx(1 / 3),
    )


def test_a_layers_gradients_join_its_variables_norms():
    kernel = variable_gradients("dense", np.array([3.0]), 1.0)
    bias = VariableGradients("dense", 4.0, 4.0, 0.5, 1.0, 0.0)
    figures = layer_gradients([kernel, bias])
    assert figures.norm == 5.0
    assert figures.flushed_norm_fraction == pytest.approx(2.0 / 5.0)
    assert layer_gradients([]).to_json() == {"norm": 0.0, "flushed_norm_fraction": 0.0}


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # np.quantile of inf
@pytest.mark.parametrize("bad, norm", [(np.inf, math.inf), (np.nan, math.nan)])
def test_figures_not_finite_stay_numbers(bad, norm):
    figures = variable_gradients("dense", np.array([1.0, bad]), 1.0)
    assert math.isnan(figures.flushed_norm_fraction)
    together = layer_gradients([figures])
    assert together.norm == norm or (math.isnan(together.norm) and math.isnan(norm))
    assert math.isnan(together.flushed_norm_fraction)
    assert math.isnan(activation_statistics(np.array([1.0, bad])).flushed_norm_fraction)
