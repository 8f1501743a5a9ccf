"""Train telemetry's tag names and their TensorBoard custom-scalars layout, in one place so
the tags `MixedPrecisionMonitor` writes and the dashboard's charts cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from tensorboard.plugins.custom_scalar import layout_pb2, metadata

# The optimizer's own step logs, written under the same names.
from mpt_keras.scaling.health import (  # noqa: F401
    BAD_BATCHES,
    FLOAT8_RANGE_USED,
    GRADIENT_NORM,
    LOSS_SCALE,
    SKIPPED_STEPS,
)

OVERFLOW_RATE = "overflow_rate"
EXAMPLES_PER_SECOND = "examples_per_second"
STEP_TIME = "step_time_seconds"
PEAK_MEMORY = "peak_memory_mib/"  # + device, e.g. "CPU:0"
NONFINITE = "nonfinite/"  # + variable path
NONFINITE_TEXT = "nonfinite_gradients"
NONFINITE_DIAGNOSIS = "nonfinite_diagnosis"
# Sample batch, + layer name (activations) or variable path (gradients).
ACTIVATION = "activation"
GRADIENT = "gradient"
LOG2_MAGNITUDE = "_log2_magnitude/"
ABOVE_FLOAT16_MAX = "_above_float16_max/"
BELOW_FLOAT16_NORMAL = "_below_float16_normal/"
# + layer path + "/" + a `Float8LayerStatistics.scalars()` name, e.g.
# "float8/block_0/mlp_up/inputs/amax".
FLOAT8 = "float8/"

LAYOUT_TITLE = "Mixed precision"


def _regex(tag: str) -> str:
    """The regex a chart selects `tag` by; a tag ending in "/": a line per family member."""
    return f"^{tag}" if tag.endswith("/") else f"^{tag}$"


_CHARTS = tuple(
    (title, _regex(tag))
    for title, tag in (
        ("Loss scale", LOSS_SCALE),
        ("Skipped steps (total)", SKIPPED_STEPS),
        ("Overflow rate (skipped / steps, per interval)", OVERFLOW_RATE),
        ("Global norm of the unscaled gradients", GRADIENT_NORM),
        ("Throughput (examples / s)", EXAMPLES_PER_SECOND),
        ("Step time (s)", STEP_TIME),
        ("Peak device memory per interval (MiB)", PEAK_MEMORY),
        ("Steps with a non-finite gradient, per variable", NONFINITE),
    )
)
_RANGE_CHARTS = tuple(
    (f"{kind.capitalize()}s {meaning}", _regex(kind + suffix))
    for kind in (ACTIVATION, GRADIENT)
    for meaning, suffix in (
        ("above the float16 max (fraction)", ABOVE_FLOAT16_MAX),
        ("below the float16 min normal (fraction)", BELOW_FLOAT16_NORMAL),
    )
)
# A chart per statistic (a `float8/` tag's last part), a line per layer and tensor.
_FLOAT8_CHARTS = tuple(
    (title, f"^{FLOAT8}.*/{statistic}$")
    for title, statistic in (
        ("Float8 scales", "scale"),
        ("Float8 amax at the last step", "amax"),
        ("Float8 range used: amax over the largest value at its scale", "range_used"),
        ("Float8 kernel values saturated at its scale (share)", "saturated"),
        ("Float8 kernel values underflowed to zero at its scale (share)", "underflowed"),
    )
)


def float8_tag(layer_path: str, statistic: str) -> str:
    """The tag of a float8 layer's statistic (`Float8LayerStatistics.scalars()` name)."""
    return f"{FLOAT8}{layer_path}/{statistic}"


def layout(histograms: bool, float8: bool = False) -> layout_pb2.Layout:
    """The dashboard: a chart per quantity, float16-range charts if `histograms`, float8 ones
    if `float8`."""
    charts = _CHARTS + (_RANGE_CHARTS if histograms else ()) + (_FLOAT8_CHARTS if float8 else ())
    return layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title=LAYOUT_TITLE,
                chart=[
                    layout_pb2.Chart(
                        title=title, multiline=layout_pb2.MultilineChartContent(tag=[regex])
                    )
                    for title, regex in charts
                ],
            )
        ]
    )


def write_layout(files: Any, histograms: bool, float8: bool = False) -> None:
    """Writes the dashboard in `files` (a summary writer of `monitor.summary_files`) at the
    log directory's top; TensorBoard merges it across runs."""
    files.serialized(
        "",
        0,
        metadata.CONFIG_SUMMARY_TAG,
        layout(histograms, float8).SerializeToString(),
        metadata.create_summary_metadata(),
    )
