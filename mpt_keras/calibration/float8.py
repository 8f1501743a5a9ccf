"""Calibration's float8 figures: what Keras' float8 would lose in each Dense and EinsumDense.

Per tensor Keras quantizes (`QUANTIZED_TENSORS`), in the float32 backward pass: amax, and the
shares saturating and underflowing at Keras' delayed scale, emulated (each batch at the largest
earlier amax; the first batch and kernel at their own), as a settled run scales. The output
gradient is unscaled: a power-of-two loss scale changes its amax, not its shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from mpt_keras.calibration.decisions import format_share
from mpt_keras.calibration.float8_speed import Float8Speed
from mpt_keras.keras_bridge.layer_calls import calls_wrapped
from mpt_keras.precision.float8 import QUANTIZED_TENSORS, float8_shares, format_max
from mpt_keras.precision.float8_gemms import gemm_shape
from mpt_keras.precision.names import LOW_PRECISION_POLICIES

# Each tensor's name in reasons, and its verb ending.
_LABELS = {
    "inputs": ("inputs", ""),
    "kernel": ("kernel", "s"),
    "outputs_grad": ("output gradient", "s"),
}


@dataclasses.dataclass(frozen=True)
class TensorFigures:
    """One quantized tensor of a layer; if not finite: `amax` inf or nan, shares nan."""

    float8_format: str
    amax: float
    saturated: float
    underflowed: float

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.float8_format,
            "amax": self.amax,
            "saturated": self.saturated,
            "underflowed": self.underflowed,
        }


@dataclasses.dataclass(frozen=True)
class Float8Figures:
    """A Dense or EinsumDense's call count, each quantized tensor's figures, and its GEMM
    `(M, K, N)` on the first calibration batch (None: not called, or no matrix product)."""

    class_name: str
    calls: int
    inputs: TensorFigures
    kernel: TensorFigures
    outputs_grad: TensorFigures
    gemm: tuple[int, int, int] | None = None

    def tensors(self) -> dict[str, TensorFigures]:
        return {tensor: getattr(self, tensor) for tensor in QUANTIZED_TENSORS}

    def to_json(self) -> dict[str, Any]:
        tensors = {tensor: figures.to_json() for tensor, figures in self.tensors().items()}
        gemm = list(self.gemm) if self.gemm else None
        return {"class": self.class_name, "calls": self.calls, "gemm": gemm, **tensors}


@dataclasses.dataclass(frozen=True)
class Float8Layer:
    """A layer's float8 figures and decision; `policy`: the manifest's."""

    figures: Float8Figures
    policy: str
    recommended: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            **self.figures.to_json(),
            "policy": self.policy,
            "recommended": self.recommended,
            "reason": self.reason,
        }


@dataclasses.dataclass
class _TensorHistory:
    float8_format: str
    amaxes: list[float] = dataclasses.field(default_factory=list)
    saturated: int = 0
    underflowed: int = 0
    values: int = 0

    def add(self, values: np.ndarray) -> None:
        """Adds one batch's values, quantized at the scale of the batches before."""
        if not values.size:
            return
        amax = float(np.max(np.abs(values)))
        if self.finite and math.isfinite(amax):
            scale = _delayed_scale(max(self.amaxes, default=amax), self.float8_format)
            shares = float8_shares(values, self.float8_format, scale)
            self.saturated += round(shares.saturated * values.size)
            self.underflowed += round(shares.underflowed * values.size)
            self.values += values.size
        self.amaxes.append(amax)

    @property
    def finite(self) -> bool:
        return all(math.isfinite(amax) for amax in self.amaxes)

    def figures(self) -> TensorFigures:
        if not self.finite:
            return TensorFigures(self.float8_format, float(np.max(self.amaxes)), math.nan, math.nan)
        total = max(self.values, 1)
        return TensorFigures(
            self.float8_format,
            max(self.amaxes, default=0.0),
            self.saturated / total,
            self.underflowed / total,
        )


def _delayed_scale(amax: float, float8_format: str) -> float:
    """The scale of a history whose largest amax is `amax`."""
    if not amax > 0:  # Keras keeps its first scale, 1, until the history holds an amax.
        return 1.0
    largest = np.float32(format_max(float8_format))
    amax = np.float32(amax)
    scale = amax / largest
    # Rounded up where amax / scale lands a rounding above the largest value (Keras' clip
    # absorbs that rounding: no saturation).
    if amax / scale > largest:
        scale = np.nextafter(scale, np.float32(np.inf))
    return float(scale)


class Float8Recorder:
    """Records the float8 figures of Dense and EinsumDense layers as a model runs.

    `layers`: `(path, layer)` of each built layer, each once. Per batch: run the model under
    `recording(tape.watch)`, then `add_batch(tape.gradient(loss, recorder.outputs))`; on JAX,
    see `measurement.gradient_statistics`.
    """

    def __init__(self, layers: Sequence[tuple[str, keras.layers.Layer]]):
        self._layers = list(layers)
        self._tensors = {
            path: {tensor: _TensorHistory(fmt) for tensor, fmt in QUANTIZED_TENSORS.items()}
            for path, _ in self._layers
        }
        self._calls = dict.fromkeys(self._tensors, 0)
        self._gemms: dict[str, tuple[int, int, int] | None] = {}
        # This batch's calls: (path, inputs, matmul output).
        self._batch: list[tuple[str, Any, Any]] = []

    @property
    def outputs(self) -> list[Any]:
        """This batch's matmul outputs, to take gradients for."""
        return [output for _, _, output in self._batch]

    def recording(
        self, watch: Callable[[Any], Any], record: bool = True
    ) -> contextlib.AbstractContextManager:
        """Inside, each call's matmul output passes through `watch` (a tape's watch; on JAX an
        added zero whose gradient is the output's) and, if `record`, is recorded."""
        paths = {id(layer): path for path, layer in self._layers}
        return calls_wrapped(
            (layer for _, layer in self._layers),
            lambda layer, call: self._recording_call(paths[id(layer)], layer, watch, record, call),
        )

    def add_batch(self, output_gradients: Sequence[Any]) -> None:
        """Adds the recorded batch, given the loss's gradients at `outputs`."""
        pieces = {path: {"inputs": [], "outputs_grad": []} for path in self._tensors}
        for (path, inputs, output), gradient in zip(self._batch, output_gradients, strict=True):
            self._calls[path] += 1
            if path not in self._gemms:
                layer = dict(self._layers)[path]
                self._gemms[path] = gemm_shape(layer, tuple(int(d) for d in inputs.shape))
            pieces[path]["inputs"].append(_flat(inputs))
            # None: the loss does not depend on it.
            pieces[path]["outputs_grad"].append(
                _flat(np.zeros(output.shape, np.float32) if gradient is None else gradient)
            )
        for path, tensors in pieces.items():
            for tensor, arrays in tensors.items():
                self._tensors[path][tensor].add(np.concatenate(arrays or [np.zeros(0, "float32")]))
        self._batch = []

    def figures(self) -> dict[str, Float8Figures]:
        """Per layer path, its figures so far."""
        figures = {}
        for path, layer in self._layers:
            kernel = _TensorHistory(QUANTIZED_TENSORS["kernel"])
            kernel.add(_flat(layer.kernel))
            tensors = {**self._tensors[path], "kernel": kernel}
            figures[path] = Float8Figures(
                type(layer).__name__,
                self._calls[path],
                **{tensor: tensors[tensor].figures() for tensor in QUANTIZED_TENSORS},
                gemm=self._gemms.get(path),
            )
        return figures

    def _recording_call(
        self,
        path: str,
        layer: keras.layers.Layer,
        watch: Callable[[Any], Any],
        record: bool,
        call: Callable[..., Any],
    ) -> Callable[..., Any]:
        """`call`, recording its inputs and its pre-activation output.

        Dense and EinsumDense apply `self.activation` last: swapped for the call with one
        that watches and records its input.
        """

        def recording_call(*args, **kwargs):
            activation = layer.activation
            before_activation = []

            def recording_activation(outputs):
                outputs = watch(outputs)
                before_activation.append(outputs)
                return outputs if activation is None else activation(outputs)

            layer.activation = recording_activation
            try:
                outputs = call(*args, **kwargs)
            finally:
                layer.activation = activation
            if record:
                inputs = args[0] if args else kwargs["inputs"]
                self._batch.append((path, inputs, before_activation[0]))
            return outputs

        return recording_call


def decide_float8(
    figures: Float8Figures,
    policy: str,
    why: str,
    default: str,
    max_saturated: float,
    max_underflowed: float,
    speed: Callable[[tuple[int, int, int]], Float8Speed] | None = None,
) -> tuple[bool, str]:
    """`(recommended, reason)`: whether a layer should train in float8, and why.

    A float8 layer computes in the manifest's `default` outside its matmuls, so only a layer
    whose `policy` is that (low-precision) default, every share within limits, and where
    `speed` judges its GEMM (`SpeedJudge.judge`; None: by the numbers alone), float8 paying.
    `why`: why a float32 `policy` (`safe default: model output`, `follows block_0`).
    """
    problems = []
    if policy not in LOW_PRECISION_POLICIES:
        problems.append(f"stays {policy} ({why})")
    elif policy != default:
        problems.append(f"{policy}, but a float8 layer computes in the default {default}")
    if not figures.calls:
        problems.append("not called on the calibration batches")
    limits = {"saturated": max_saturated, "underflowed": max_underflowed}
    verbs = {"saturated": "saturate", "underflowed": "underflow"}
    tensors = figures.tensors()
    for tensor, (label, ending) in _LABELS.items():
        tensor_figures = tensors[tensor]
        if not math.isfinite(tensor_figures.amax):
            problems.append(f"{label} not finite in float32")
            continue
        for share, limit in limits.items():
            value = getattr(tensor_figures, share)
            if value > limit:
                problems.append(
                    f"{label} {verbs[share]}{ending} {format_share(value)} "
                    f"in {tensor_figures.float8_format} > {format_share(limit)}"
                )
    if figures.calls and figures.gemm is None:
        problems.append("its equation is no single matrix product (a batch dimension)")
    judged = speed(figures.gemm) if speed is not None and figures.gemm and not problems else None
    if judged is not None and not judged.pays:
        problems.append(judged.reason)
    if problems:
        return False, "; ".join(problems) + " -> not float8"
    amaxes = ", ".join(
        f"{label} {tensors[tensor].amax:.3g}" for tensor, (label, _) in _LABELS.items()
    )
    largest = {
        share: max(getattr(tensors[tensor], share) for tensor in _LABELS) for share in limits
    }
    return True, (
        f"amax: {amaxes}; at most {format_share(largest['saturated'])} saturate and "
        f"{format_share(largest['underflowed'])} underflow in e4m3/e5m2 "
        f"(<= {format_share(max_saturated)}, <= {format_share(max_underflowed)})"
        + (f"; {judged.reason}" if judged is not None else "")
        + " -> float8"
    )


def _flat(tensor: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(tensor), dtype=np.float32).ravel()
