"""Where a train step's time goes: the TensorFlow profiler's op times, by category.

Op time is summed over the executor's threads (it can exceed a step's wall
time; its fractions say where the work is). An XLA-compiled step is one
opaque cluster: profile with XLA off. `speedup_with_peak_matmuls` says what
faster matmuls alone could gain: below a goal, they cannot reach it. TensorFlow only: on
Keras' JAX backend `profile_steps` is refused (`suite.measure`).
"""

from __future__ import annotations

import collections
import glob
import os
import re
from collections.abc import Callable, Mapping

CATEGORIES = ("matmul", "cast", "other")
# Matrix products (oneDNN's `_Mkl*` rewrites and gradients included).
_MATMUL = re.compile(r"^_?(Mkl)?(Native)?(Fused)?(Batch)?(MatMul|Einsum|Conv|DepthwiseConv)")
_EXECUTOR_THREADS = "tf_Compute"
METHOD = (
    "TensorFlow profiler trace of profile_steps train steps per XLA-off variant, after the "
    "timed rounds: per op type, the summed duration of the executor's op events (all its "
    "threads) / steps; matmul = MatMul, BatchMatMul, Einsum, Conv and their oneDNN forms and "
    "gradients; speedup_with_peak_matmuls = T / (M / r + C + O): T, M the float32 variant's "
    "op and matmul time, C, O this variant's cast and other op time, r the dtype's matmul "
    "peak over float32's"
)


def capture(run_steps: Callable[[int], object], steps: int, log_dir: str) -> str:
    """Runs `run_steps(steps)` under the TensorFlow profiler; returns the trace file's path.

    The trace (under `log_dir`, TensorBoard's `plugins/profile` layout) opens
    in TensorBoard's Profile tab (`tensorboard-plugin-profile`).
    """
    import tensorflow as tf

    tf.profiler.experimental.start(log_dir)
    try:
        run_steps(steps)
    finally:
        tf.profiler.experimental.stop()
    traces = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    if not traces:
        raise RuntimeError(f"the TensorFlow profiler wrote no trace under {log_dir}")
    return max(traces, key=os.path.getmtime)


def op_seconds(trace_path: str, steps: int) -> dict[str, float]:
    """Seconds per step of each op type the executor ran (read from the `.xplane.pb`
    trace), most first."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(trace_path, "rb") as file:
        space.ParseFromString(file.read())
    totals: collections.Counter[str] = collections.Counter()
    for plane in space.planes:
        names = {key: metadata.name for key, metadata in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith(_EXECUTOR_THREADS):
                continue
            for event in line.events:
                name = names.get(event.metadata_id, "")
                # "<node name>:<op type>"; the executor's own events are not ops.
                node, _, op_type = name.rpartition(":")
                if node and not node.endswith(":"):
                    totals[op_type] += event.duration_ps * 1e-12 / steps
    return dict(totals.most_common())


def category(op_type: str) -> str:
    """The `CATEGORIES` entry of an op type."""
    if _MATMUL.match(op_type):
        return "matmul"
    return "cast" if op_type == "Cast" else "other"


def breakdown(seconds: Mapping[str, float]) -> dict[str, float]:
    """Seconds per step per category, and their `total`."""
    result = dict.fromkeys(CATEGORIES, 0.0)
    for op_type, value in seconds.items():
        result[category(op_type)] += value
    result["total"] = sum(result[name] for name in CATEGORIES)
    return result


def speedup_with_peak_matmuls(
    float32: Mapping[str, float], low: Mapping[str, float], peak_ratio: float
) -> float:
    """`T / (M / r + C + O)`: float32's op time over `low`'s, were `low`'s matmuls
    float32's `M` at the matmul peak ratio `r` (its casts `C`, other ops `O` as measured).

    Args:
        float32, low: `breakdown` of the float32 and the lower-precision variant.
    """
    return float32["total"] / (float32["matmul"] / peak_ratio + low["cast"] + low["other"])
