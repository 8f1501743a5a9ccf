"""Tests of mpt_keras.calibration.result: the statistics' JSON and table."""

import json
import math

from mpt_keras import PrecisionManifest
from mpt_keras.calibration.decisions import CalibrationThresholds, Decision
from mpt_keras.calibration.float8 import Float8Figures, Float8Layer, TensorFigures
from mpt_keras.calibration.result import (
    CalibrationResult,
    CalibrationStatistics,
    LayerStatistics,
    format_calibration_table,
    format_figure,
)
from mpt_keras.calibration.statistics import (
    ActivationStatistics,
    LayerGradients,
    OutputErrors,
    VariableGradients,
)


def _activations(value):
    return ActivationStatistics(value, value, value, value, 0.0, 0.0, 0.0, 0.0)


def _statistics(float8=False):
    clean = TensorFigures("e4m3", 2.0, 0.0625, 0.0)
    broken = TensorFigures("e5m2", math.inf, math.nan, math.nan)
    return CalibrationStatistics(
        model="net",
        steps=1,
        seed=0,
        initial_scale=2.0**15,
        thresholds=CalibrationThresholds(),
        default="mixed_float16",
        layers={
            "big": LayerStatistics(
                "Times",
                _activations(1e5),
                LayerGradients(math.nan, math.nan),
                OutputErrors(math.inf, 1e-3),
                Decision("mixed_bfloat16", "activation max 1e+05 > 8188 -> mixed_bfloat16"),
            ),
            "drop": LayerStatistics(
                "Dropout",
                _activations(1.0),
                LayerGradients(0.0, 0.0),
                None,
                Decision("mixed_float16", "no compute worth measuring -> the default"),
            ),
        },
        gradients={"big/kernel": VariableGradients("big", math.nan, math.nan, math.nan, 1.0, 0.0)},
        diagnosis="statistics batch 1 of 1: first non-finite gradient: big/kernel",
        float8=float8,
        float8_layers={
            "dense": Float8Layer(
                Float8Figures("Dense", 1, clean, clean, broken),
                "mixed_float16",
                False,
                "output gradient not finite in float32 -> not float8",
            )
        },
    )


def test_non_finite_numbers_are_written_as_the_toolkit_writes_them():
    values = _statistics().to_json()

    assert values["layers"]["big"]["errors"] == {"mixed_float16": "inf", "mixed_bfloat16": 1e-3}
    assert values["layers"]["big"]["gradients"] == {"norm": "nan", "flushed_norm_fraction": "nan"}
    assert values["layers"]["drop"]["errors"] is None
    assert values["gradients"]["big/kernel"]["max"] == "nan"
    assert values["float8_layers"]["dense"]["outputs_grad"] == {
        "format": "e5m2",
        "amax": "inf",
        "saturated": "nan",
        "underflowed": "nan",
    }
    assert list(values) == [
        "model", "steps", "seed", "initial_scale", "thresholds", "default", "layers",
        "gradients", "diagnosis", "float8", "float8_layers",
    ]  # fmt: skip
    assert list(values["layers"]["big"]) == [
        "class", "activations", "gradients", "errors", "policy", "reason"
    ]  # fmt: skip
    assert list(values["float8_layers"]["dense"]) == [
        "class", "calls", "gemm", "inputs", "kernel", "outputs_grad", "policy", "recommended",
        "reason",
    ]  # fmt: skip
    text = CalibrationResult(values, PrecisionManifest("mixed_float16")).to_json()
    assert json.loads(text) == values  # Strict JSON: no NaN or Infinity.


def test_the_table_writes_nonfinite_and_a_dash_for_errors_not_measured():
    result = CalibrationResult(_statistics().to_json(), PrecisionManifest("mixed_float16"))
    table = format_calibration_table(result.statistics).splitlines()
    assert str(result) == result.table() == "\n".join(table) + "\n"  # print(result) shows it.

    assert table == [
        "path  class    act_max  fp16_err   bf16_err  policy          reason",
        "big   Times    1e+05    nonfinite  0.001     mixed_bfloat16  "
        "activation max 1e+05 > 8188 -> mixed_bfloat16",
        "drop  Dropout  1        -          -         mixed_float16   "
        "no compute worth measuring -> the default",
        "statistics batch 1 of 1: first non-finite gradient: big/kernel",
    ]


def test_the_float8_table_follows_when_float8_rules_were_asked_for():
    table = format_calibration_table(_statistics(float8=True).to_json()).splitlines()

    float8_table = table[table.index("") + 1 : -1]
    assert float8_table[0].split() == [
        "path", "class", "in_amax", "in_sat", "in_under", "k_amax", "k_under",
        "g_amax", "g_sat", "g_under", "policy", "reason",
    ]  # fmt: skip
    assert float8_table[1].split()[:10] == [
        "dense", "Dense", "2", "6.25%", "0%", "2", "0%", "nonfinite", "nonfinite", "nonfinite",
    ]  # fmt: skip


def test_figures_are_written_with_three_digits():
    assert [format_figure(value) for value in (4.3412, 0.0, 1e-7, "inf", "nan", -math.inf)] == [
        "4.34",
        "0",
        "1e-07",
        "nonfinite",
        "nonfinite",
        "nonfinite",
    ]
