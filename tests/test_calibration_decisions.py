"""Tests of mpt_keras.calibration.decisions: the thresholds and the reasons of a decision."""

import math

import keras
import pytest

from mpt_keras import UserInputError
from mpt_keras.calibration.decisions import (
    CalibrationThresholds,
    Decider,
    Decision,
    GroupFigures,
    format_share,
)
from mpt_keras.calibration.sites import Group, Site
from mpt_keras.calibration.statistics import ActivationStatistics, LayerGradients, OutputErrors


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("max_float16_error", 0, "a number > 0"),
        ("max_flushed_norm_fraction", -1, "a number > 0 and <= 1"),
        ("float16_headroom", 0.5, "a number >= 1"),
        ("max_float8_saturated_fraction", 0, "a number > 0 and <= 1"),
        ("max_float8_underflowed_fraction", 1.5, "a number > 0 and <= 1"),
        ("max_bfloat16_error", math.inf, "a number > 0"),
    ],
)
def test_bad_thresholds_are_one_line_errors(field, value, allowed):
    with pytest.raises(UserInputError) as raised:
        CalibrationThresholds(**{field: value})
    assert str(raised.value) == (
        f"CalibrationThresholds.{field}: received {value!r}. Allowed: {allowed}"
    )


def _figures(activation_max=1.0, flushed=0.0, gradient_flushed=0.0, errors=(1e-4, 1e-3)):
    activations = ActivationStatistics(
        max=activation_max,
        p99=activation_max,
        p99_9=activation_max,
        p99_99=activation_max,
        above_float16_max_fraction=0.0,
        below_normal_fraction=0.0,
        below_subnormal_fraction=0.0,
        flushed_norm_fraction=flushed,
    )
    return GroupFigures(activations, LayerGradients(1.0, gradient_flushed), OutputErrors(*errors))


def _group(path="dense"):
    site = Site(path, keras.layers.Dense(2), calls=[((), {}, None)])
    return Group(site, (site,))


def _decide(figures, safe_defaults=None):
    decider = Decider(CalibrationThresholds(), 2.0**15, safe_defaults or {})
    return decider.measured(_group(), figures, holds_sites=False)


def test_a_layer_within_every_threshold_gets_float16():
    assert _decide(_figures()) == Decision(
        "mixed_float16", "range fits float16, error 0.0001 <= 0.01 -> mixed_float16"
    )


def test_each_problem_of_the_range_is_named_with_the_float16_limits():
    figures = _figures(activation_max=1e5, flushed=0.5, gradient_flushed=0.25)
    assert _decide(figures) == Decision(
        "mixed_bfloat16",
        "activation max 1e+05 > 8188 (float16 max 65504 / headroom 8); "
        "activations: 50% of their norm flushes to zero in float16 (below 6e-08; > 1%); "
        "gradient x 32768: 25% of its norm flushes to zero in float16 (below 6e-08; > 1%) "
        "-> mixed_bfloat16",
    )


def test_a_figure_not_finite_reads_as_inf_or_is_no_problem():
    # A nan flushed fraction (a norm not finite in float32) rules nothing out;
    # a nan error (an output not finite in float16) is an error of inf.
    figures = _figures(flushed=math.nan, gradient_flushed=math.nan, errors=(math.nan, 1e-3))
    assert _decide(figures) == Decision(
        "mixed_bfloat16", "float16 error inf > 0.01 -> mixed_bfloat16"
    )
    figures = _figures(errors=(math.inf, math.nan))
    assert _decide(figures) == Decision(
        "float32", "float16 error inf > 0.01; bfloat16 error inf > 0.05 -> float32"
    )


def test_a_safe_default_keeps_the_group_float32():
    reason = "safe default: model output"
    assert _decide(_figures(), {"dense": reason}) == Decision("float32", reason)


def test_shares_are_written_with_three_digits():
    assert [format_share(share) for share in (0.000153, 0.0625, 1.0)] == [
        "0.0153%",
        "6.25%",
        "100%",
    ]
