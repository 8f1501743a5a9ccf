"""Tag names of the train telemetry and their TensorBoard custom-scalars layout.

`MixedPrecisionMonitor` writes under these tags; `write_layout` writes the
"Mixed precision" dashboard that groups them, so that the tags and the charts
cannot drift apart.
"""

from __future__ import annotations

import tensorflow as tf
from tensorboard.plugins.custom_scalar import layout_pb2, metadata

# Also entries of the Keras logs of every train step with our optimizer
# (`LossScaleOptimizer.step_logs`).
LOSS_SCALE = "loss_scale"
SKIPPED_STEPS = "skipped_steps"
BAD_BATCHES = "bad_batches"
OVERFLOW_RATE = "overflow_rate"
GRADIENT_NORM = "gradient_norm"
EXAMPLES_PER_SECOND = "examples_per_second"
STEP_TIME = "step_time_seconds"
PEAK_MEMORY = "peak_memory_mib/"  # + device, e.g. "CPU:0"
NONFINITE = "nonfinite/"  # + variable path
NONFINITE_TEXT = "nonfinite_gradients"
NONFINITE_DIAGNOSIS = "nonfinite_diagnosis"
# Sample-batch statistics, + layer name (activations) or variable path (gradients).
ACTIVATION = "activation"
GRADIENT = "gradient"
LOG2_MAGNITUDE = "_log2_magnitude/"
ABOVE_FLOAT16_MAX = "_above_float16_max/"
BELOW_FLOAT16_NORMAL = "_below_float16_normal/"

LAYOUT_TITLE = "Mixed precision"

_CHARTS = (
    ("Loss scale", LOSS_SCALE),
    ("Skipped steps (total)", SKIPPED_STEPS),
    ("Overflow rate (skipped / steps, per interval)", OVERFLOW_RATE),
    ("Global norm of the unscaled gradients", GRADIENT_NORM),
    ("Throughput (examples / s)", EXAMPLES_PER_SECOND),
    ("Step time (s)", STEP_TIME),
    ("Peak device memory per interval (MiB)", PEAK_MEMORY),
    ("Steps with a non-finite gradient, per variable", NONFINITE),
)
_RANGE_CHARTS = tuple(
    (f"{kind.capitalize()}s {meaning}", kind + suffix)
    for kind in (ACTIVATION, GRADIENT)
    for meaning, suffix in (
        ("above the float16 max (fraction)", ABOVE_FLOAT16_MAX),
        ("below the float16 min normal (fraction)", BELOW_FLOAT16_NORMAL),
    )
)


def layout(histograms: bool) -> layout_pb2.Layout:
    """The dashboard: one chart per quantity, float16-range charts if `histograms`."""
    charts = _CHARTS + (_RANGE_CHARTS if histograms else ())
    return layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title=LAYOUT_TITLE,
                chart=[
                    layout_pb2.Chart(
                        title=title,
                        # A tag ending in "/" is a family: one line per member.
                        multiline=layout_pb2.MultilineChartContent(
                            tag=[f"^{tag}" if tag.endswith("/") else f"^{tag}$"]
                        ),
                    )
                    for title, tag in charts
                ],
            )
        ]
    )


def write_layout(writer: tf.summary.SummaryWriter, histograms: bool) -> None:
    """Writes the dashboard with `writer`; TensorBoard merges it across runs."""
    with writer.as_default():
        tf.summary.write(
            metadata.CONFIG_SUMMARY_TAG,
            tf.constant(layout(histograms).SerializeToString()),
            step=0,
            metadata=metadata.create_summary_metadata().SerializeToString(),
        )
