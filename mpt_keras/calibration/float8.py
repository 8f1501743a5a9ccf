"""Calibration's float8 figures: what Keras' float8 would lose in each Dense and EinsumDense.

`calibrate` (`mpt_keras.calibration.calibrate`) measures them in its float32 backward
pass, for every `Dense` and `EinsumDense` (Keras' own classes,
`float8.FLOAT8_LAYER_CLASSES`) among the layers it measures and their
sublayers (a DecoderBlock's projections too), and decides on them here.

Per layer, for each tensor Keras' float8 quantizes (`float8.QUANTIZED_TENSORS`):

    inputs        e4m3  what the layer is called on
    kernel        e4m3  its kernel
    outputs_grad  e5m2  the gradient of the loss (sample weights applied) at
                        the layer's matmul output, its output gradient before
                        its activation: where Keras quantizes it

its amax (largest magnitude, over all batches) and the shares of its values
that saturate (above the format's largest value at the scale, so clipped to
it) and that underflow (nonzero, zero in the format), `float8.float8_shares`.

The scale float8 would use. Keras scales each tensor by delayed scaling: the
largest amax of a history of the steps before, over the format's largest
value (448 in e4m3, 57344 in e5m2). Calibration emulates it over its batches:
each batch is quantized at the scale of the largest amax of the batches
before it, the first (which has none) at its own. So a batch larger than all
before it saturates, as in a run, and one batch alone measures underflow only.
The kernel, the same on every batch, is quantized at its own amax and never
saturates. A scale is rounded up by one float32 unit where the amax itself
would land a rounding above the format's largest value: Keras' clip changes
such a value by less than its own rounding, which is no saturation.
This is one step less delay than Keras' own: a Keras step quantizes at the
largest amax up to two steps before it, and its first two steps at the
initial scale of 1 (`mpt_keras.precision.float8`). Calibration leaves those
two steps out, which quantize any tensor whose amax is far from the format's
largest value badly, and measures the scaling a run settles into; a
growing tensor saturates one step later in a run than here.

The loss scale. The output gradient is measured unscaled. In a float16 run the
loss scale multiplies it and, through its amax history, its float8 scale
alike: the shares are the same (exactly, for a power-of-two loss scale) and
only the amax differs, by the loss scale. bfloat16 runs unscaled.

The decision (`decide_float8`). A float8 layer computes in the manifest's
default policy outside its matmuls (`precision.manifest`). So a layer is
recommended when its own decision without float8 is that default, a
low-precision policy, and each tensor's saturated and underflowed shares are
within the thresholds. A layer kept float32, by a safe default (the model
output) or for its numbers, is not: float8 would compute it in the default and
its matmul in 8 bits. Nor is one whose own decision is another low precision
than the default (its range or errors chose it). Each reason names the figures.

Example:

    recorder = Float8Recorder([("dense", dense)])
    with tf.GradientTape() as tape, recorder.recording(tape):
        loss = keras.ops.mean(model(features))
    recorder.add_batch(tape.gradient(loss, recorder.outputs))
    recorder.figures()["dense"]["inputs"]
    # {'format': 'e4m3', 'amax': 2.0, 'saturated': 0.0, 'underflowed': 0.0}
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.precision.float8 import QUANTIZED_TENSORS, float8_shares, format_max
from mpt_keras.precision.names import LOW_PRECISION_POLICIES

# How reasons and the table name each tensor, and the ending of a verb after it.
_LABELS = {
    "inputs": ("inputs", ""),
    "kernel": ("kernel", "s"),
    "outputs_grad": ("output gradient", "s"),
}
FLOAT8_TABLE_COLUMNS = (
    "path", "class", "in_amax", "in_sat", "in_under", "k_amax", "k_under",
    "g_amax", "g_sat", "g_under", "policy", "reason",
)  # fmt: skip


@dataclasses.dataclass
class _TensorFigures:
    """One quantized tensor of one layer, batch by batch.

    Attributes:
        float8_format: `e4m3` or `e5m2`.
        amaxes: The amax of each batch so far: the delayed scale's history.
        saturated: Values that saturated, over all batches.
        underflowed: Values that underflowed, over all batches.
        values: Values seen, over all batches.
        finite: Whether every value seen was finite.
    """

    float8_format: str
    amaxes: list[float] = dataclasses.field(default_factory=list)
    saturated: int = 0
    underflowed: int = 0
    values: int = 0
    finite: bool = True

    def add(self, values: np.ndarray) -> None:
        """Adds one batch's values, quantized at the scale of the batches before."""
        if not values.size:
            return
        amax = float(np.max(np.abs(values)))
        self.finite = self.finite and math.isfinite(amax)
        if self.finite:
            history = max(self.amaxes, default=amax)
            scale = _delayed_scale(history, self.float8_format)
            shares = float8_shares(values, self.float8_format, scale)
            # Each share is a count over the size: times the size, the count again,
            # so that batches of any size add up.
            self.saturated += round(shares.saturated * values.size)
            self.underflowed += round(shares.underflowed * values.size)
            self.values += values.size
        self.amaxes.append(amax)

    def figures(self) -> dict[str, Any]:
        """`format`, `amax`, `saturated` and `underflowed` (shares); None when not finite."""
        if not self.finite:
            return {
                "format": self.float8_format,
                "amax": None,
                "saturated": None,
                "underflowed": None,
            }
        total = max(self.values, 1)
        return {
            "format": self.float8_format,
            "amax": max(self.amaxes, default=0.0),
            "saturated": self.saturated / total,
            "underflowed": self.underflowed / total,
        }


def _delayed_scale(amax: float, float8_format: str) -> float:
    """The scale of a history whose largest amax is `amax`; see "The scale" above."""
    if not amax > 0:  # Keras keeps its first scale, 1, until the history holds an amax.
        return 1.0
    largest = np.float32(format_max(float8_format))
    amax = np.float32(amax)
    scale = amax / largest
    if amax / scale > largest:
        scale = np.nextafter(scale, np.float32(np.inf))
    return float(scale)


class Float8Recorder:
    """Records the float8 figures of Dense and EinsumDense layers as a model runs.

    Args:
        layers: `(path, layer)` of each layer to measure, built, each once.
    """

    def __init__(self, layers: Sequence[tuple[str, keras.layers.Layer]]):
        self._layers = list(layers)
        self._tensors = {
            path: {tensor: _TensorFigures(fmt) for tensor, fmt in QUANTIZED_TENSORS.items()}
            for path, _ in self._layers
        }
        self._calls = dict.fromkeys(self._tensors, 0)
        # This batch's calls: (path, inputs, matmul output).
        self._batch: list[tuple[str, Any, tf.Tensor]] = []

    @property
    def outputs(self) -> list[tf.Tensor]:
        """The matmul output of each call of this batch, to take gradients for."""
        return [output for _, _, output in self._batch]

    def recording(self, tape: tf.GradientTape) -> contextlib.AbstractContextManager:
        """Records each call of the layers while the model runs one batch under `tape`."""
        paths = {id(layer): path for path, layer in self._layers}
        return calls_wrapped(
            (layer for _, layer in self._layers),
            lambda layer, call: self._recording_call(paths[id(layer)], layer, tape, call),
        )

    def add_batch(self, output_gradients: Sequence[tf.Tensor | None]) -> None:
        """Adds the batch recorded, given the gradients of the loss at `outputs`."""
        pieces = {path: {"inputs": [], "outputs_grad": []} for path in self._tensors}
        for (path, inputs, output), gradient in zip(self._batch, output_gradients, strict=True):
            self._calls[path] += 1
            pieces[path]["inputs"].append(_flat(inputs))
            # None: the loss does not depend on this output.
            pieces[path]["outputs_grad"].append(
                _flat(tf.zeros_like(output) if gradient is None else gradient)
            )
        for path, tensors in pieces.items():
            for tensor, arrays in tensors.items():
                self._tensors[path][tensor].add(np.concatenate(arrays or [np.zeros(0, "float32")]))
        self._batch = []

    def figures(self) -> dict[str, dict[str, Any]]:
        """Per layer path: `class`, `calls` and each tensor's figures (`_TensorFigures.figures`)."""
        figures = {}
        for path, layer in self._layers:
            kernel = _TensorFigures(QUANTIZED_TENSORS["kernel"])
            kernel.add(_flat(layer.kernel))
            tensors = {**self._tensors[path], "kernel": kernel}
            figures[path] = {
                "class": type(layer).__name__,
                "calls": self._calls[path],
                **{tensor: tensors[tensor].figures() for tensor in QUANTIZED_TENSORS},
            }
        return figures

    def _recording_call(
        self,
        path: str,
        layer: keras.layers.Layer,
        tape: tf.GradientTape,
        call: Callable[..., Any],
    ) -> Callable[..., Any]:
        """`call`, the layer's, recording its inputs and its output before the activation.

        Dense and EinsumDense apply `self.activation` last: for the call, it is
        one that records what it is given (the matmul output plus the bias,
        whose gradient is the matmul output's) and watches it on `tape`.
        """

        def recording_call(*args, **kwargs):
            activation = layer.activation
            before_activation = []

            def recording_activation(outputs):
                tape.watch(outputs)
                before_activation.append(outputs)
                return outputs if activation is None else activation(outputs)

            layer.activation = recording_activation
            try:
                outputs = call(*args, **kwargs)
            finally:
                layer.activation = activation
            inputs = args[0] if args else kwargs["inputs"]
            self._batch.append((path, inputs, before_activation[0]))
            return outputs

        return recording_call


def decide_float8(
    figures: dict[str, Any],
    policy: str,
    why: str,
    default: str,
    max_saturated: float,
    max_underflowed: float,
) -> tuple[bool, str]:
    """Whether a layer should train in float8, and why; see "The decision" above.

    Args:
        figures: The layer's figures (`Float8Recorder.figures`).
        policy: Its own decision without float8.
        why: Why it has that policy when float32 (`safe default: model output`,
            `for its numbers`, `follows block_0`).
        default: The manifest's default policy.
        max_saturated: The largest share of a tensor's values that may saturate.
        max_underflowed: The largest share that may underflow.

    Returns:
        `(recommended, reason)`: the reason ends in `-> float8` or `-> not float8`.
    """
    problems = []
    if policy not in LOW_PRECISION_POLICIES:
        problems.append(f"stays {policy} ({why})")
    elif policy != default:
        problems.append(f"{policy}, but a float8 layer computes in the default {default}")
    if not figures["calls"]:
        problems.append("not called on the calibration batches")
    limits = {"saturated": max_saturated, "underflowed": max_underflowed}
    verbs = {"saturated": "saturate", "underflowed": "underflow"}
    for tensor, (label, ending) in _LABELS.items():
        tensor_figures = figures[tensor]
        if tensor_figures["amax"] is None:
            problems.append(f"{label} not finite in float32")
            continue
        for share, limit in limits.items():
            if tensor_figures[share] > limit:
                problems.append(
                    f"{label} {verbs[share]}{ending} {format_share(tensor_figures[share])} "
                    f"in {tensor_figures['format']} > {format_share(limit)}"
                )
    if problems:
        return False, "; ".join(problems) + " -> not float8"
    amaxes = ", ".join(
        f"{label} {figures[tensor]['amax']:.3g}" for tensor, (label, _) in _LABELS.items()
    )
    largest = {share: max(figures[tensor][share] for tensor in _LABELS) for share in limits}
    return True, (
        f"amax: {amaxes}; at most {format_share(largest['saturated'])} saturate and "
        f"{format_share(largest['underflowed'])} underflow in e4m3/e5m2 "
        f"(<= {format_share(max_saturated)}, <= {format_share(max_underflowed)}) -> float8"
    )


def float8_table_rows(float8_layers: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row per layer of calibration's `float8_layers`, as `FLOAT8_TABLE_COLUMNS`.

    The kernel's saturation is left out: at its own scale it is none.
    """
    rows = []
    for path, layer in float8_layers.items():
        inputs, kernel, gradient = (layer[tensor] for tensor in QUANTIZED_TENSORS)
        rows.append(
            (
                path,
                layer["class"],
                format_figure(inputs["amax"]),
                _share_or_nonfinite(inputs["saturated"]),
                _share_or_nonfinite(inputs["underflowed"]),
                format_figure(kernel["amax"]),
                _share_or_nonfinite(kernel["underflowed"]),
                format_figure(gradient["amax"]),
                _share_or_nonfinite(gradient["saturated"]),
                _share_or_nonfinite(gradient["underflowed"]),
                layer["policy"],
                layer["reason"],
            )
        )
    return rows


def format_share(fraction: float) -> str:
    """A share as calibration's reasons write it (`0.0153%`)."""
    return f"{100 * fraction:.3g}%"


def format_figure(value: float | None) -> str:
    """A figure as calibration's tables write it (`4.34`; `nonfinite` for None)."""
    return "nonfinite" if value is None else f"{value:.3g}"


def _share_or_nonfinite(fraction: float | None) -> str:
    return "nonfinite" if fraction is None else format_share(fraction)


def _flat(tensor: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(tensor), dtype=np.float32).ravel()
