"""A validation's two loss curves, as a PNG (NumPy and zlib: no plotting library) and as
TensorBoard scalars, on either Keras backend."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mpt_keras.images import encode_png
from mpt_keras.telemetry.monitor import summary_files
from mpt_keras.validation.thresholds import BASELINE

_CURVE_COLORS = {"baseline": (31, 119, 180), "candidate": (255, 127, 14)}


def plot_loss_curves(
    baseline: Sequence[float], candidate: Sequence[float], width: int = 640, height: int = 400
) -> bytes:
    """The two loss curves as PNG bytes: float32 blue, candidate orange.

    The y axis spans both curves' finite losses; non-finite ones are left out.
    """
    image = np.full((height, width, 3), 255, np.uint8)
    margin = 20
    image[margin, margin:-margin] = image[-margin, margin:-margin] = 160
    image[margin:-margin, margin] = image[margin:-margin, -margin] = 160
    finite = [value for value in (*baseline, *candidate) if math.isfinite(value)]
    bottom, top = min(finite, default=0.0), max(finite, default=1.0)
    span = (top - bottom) or 1.0
    for name, losses in (("baseline", baseline), ("candidate", candidate)):
        count = max(len(losses) - 1, 1)
        points = [
            (
                margin + (width - 2 * margin) * index / count,
                height - margin - (height - 2 * margin) * (value - bottom) / span,
            )
            for index, value in enumerate(losses)
            if math.isfinite(value)
        ]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            samples = int(max(abs(x1 - x0), abs(y1 - y0))) + 2
            xs = np.linspace(x0, x1, samples).round().astype(int)
            ys = np.linspace(y0, y1, samples).round().astype(int)
            for offset in (-1, 0, 1):  # Three pixels thick, to be seen.
                image[np.clip(ys + offset, 0, height - 1), xs] = _CURVE_COLORS[name]
    return encode_png(image)


def write_loss_curves(log_dir: str, baseline: Sequence[float], candidate: Sequence[float]) -> None:
    """Writes the curves as `validation/loss` under `log_dir/float32` and `/candidate`."""
    writers = summary_files(log_dir)
    for name, losses in ((BASELINE, baseline), ("candidate", candidate)):
        for step, loss in enumerate(losses, start=1):
            writers.scalar(name, step, "validation/loss", loss)
    writers.flush()
