"""Whether float8 pays for a layer's GEMM on this device: measured, never assumed.

Float8 is faster only where float8 GEMMs run (tensor cores of compute capability 8.9 and
later, reached through XLA) and only where a GEMM is large enough that quantizing its operands
costs less than the faster multiply saves: on one H100 two float8 MLP blocks ran 1.12x
bfloat16 at width 768 and 1.02x at width 4096 (Keras' float8, 2026). So calibration times
each float8 candidate's GEMM shape `[M, K] x [K, N]` here, forward and both gradients, in
float8 (`precision.float8_gemms`) and in the compute dtype, side by side, and refuses float8
below `CalibrationThresholds.min_float8_speedup`. Where no float8 GEMM exists (a CPU), float8
is emulated and cannot pay: nothing is timed. `float8_speed="ignore"` decides by the numbers
alone (calibrating on one machine for another).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import numpy as np
from keras import ops

from mpt_keras.backend import current
from mpt_keras.precision.float8_gemms import einsum_float8
from mpt_keras.precision.hardware import HardwareProbe, float8_gemm_support, probe_hardware

FLOAT8_SPEEDS = ("measure", "ignore")
# Timed calls of each program after its compile, alternating, median taken.
REPEATS = 5
GemmShape = tuple[int, int, int]  # M, K, N.
Timer = Callable[[GemmShape, str], tuple[float, float]]


@dataclasses.dataclass(frozen=True)
class Float8Speed:
    """A GEMM shape's verdict: `speedup` (the compute dtype's seconds over float8's; None
    where nothing was timed), whether float8 `pays`, and the `reason` with the figure."""

    shape: GemmShape
    speedup: float | None
    pays: bool
    reason: str


class SpeedJudge:
    """Judges GEMM shapes for one compute dtype; each shape is timed once."""

    def __init__(
        self,
        compute_dtype: str,
        min_speedup: float,
        probe: HardwareProbe | None = None,
        timer: Timer | None = None,
    ):
        self._dtype = compute_dtype
        self._min = min_speedup
        self._supported, self._device = float8_gemm_support(probe or probe_hardware())
        self._timer = timer or gemm_seconds
        self._verdicts: dict[GemmShape, Float8Speed] = {}

    def judge(self, shape: GemmShape) -> Float8Speed:
        if not self._supported:
            return Float8Speed(
                shape, None, False, f"no float8 GEMMs here ({self._device}): emulated, cannot pay"
            )
        if shape not in self._verdicts:
            wide, narrow = self._timer(shape, self._dtype)
            speedup = wide / narrow
            size = "x".join(map(str, shape))
            self._verdicts[shape] = Float8Speed(
                shape,
                speedup,
                speedup >= self._min,
                f"float8 GEMMs {speedup:.2f}x {self._dtype} at {size} "
                f"(measured here, needs >= {self._min:g}x)",
            )
        return self._verdicts[shape]


def gemm_seconds(shape: GemmShape, compute_dtype: str) -> tuple[float, float]:
    """Median seconds of one forward and backward GEMM `[M, K] x [K, N]`: `(in the compute
    dtype, in float8)`, both XLA-compiled, timed alternately after their compiles."""
    rows, inner, columns = shape
    rng = np.random.default_rng(0)
    x = ops.cast(rng.standard_normal((rows, inner)).astype("float32"), compute_dtype)
    kernel = ops.cast(rng.standard_normal((inner, columns)).astype("float32"), compute_dtype)
    state = {
        tensor: (ops.ones(()), ops.zeros((16,))) for tensor in ("inputs", "kernel", "outputs_grad")
    }

    def wide(x, kernel):
        return ops.sum(ops.cast(ops.einsum("mk,kn->mn", x, kernel), "float32"))

    def narrow(x, kernel):
        outputs = einsum_float8("mk,kn->mn", x, kernel, state, "delayed")
        return ops.sum(ops.cast(outputs, "float32"))

    if current.is_jax():
        from mpt_keras.backend.jax.compiled import compiled_gradients
    else:
        from mpt_keras.backend.tensorflow.compiled import compiled_gradients
    programs = [compiled_gradients(wide), compiled_gradients(narrow)]
    seconds: list[list[float]] = [[], []]
    for repeat in range(REPEATS + 1):
        for index, program in enumerate(programs):
            start = time.perf_counter()
            ops.convert_to_numpy(program(x, kernel)[1])  # Waits for the device.
            if repeat:  # The first call compiles.
                seconds[index].append(time.perf_counter() - start)
    return statistics.median(seconds[0]), statistics.median(seconds[1])
