"""Diagnosis: the first layer with a non-finite output, or the first non-finite gradient.

A loss scale says a float16 step overflowed, not where. The layer named (by path, as a
manifest rule matches) is the innermost that first made an inf or NaN, or the model when only
its own code did; inputs are taken before Keras casts them (`calls_before_cast`), so a float32
value too large for float16 names the float16 layer it feeds.

Example:

    print(diagnose_nonfinite(model, features, labels))
    # first non-finite output: block_1/mlp/dense (float16), input max 7.1e+04, weight max 0.31
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from mpt_keras import compat
from mpt_keras.backend import current
from mpt_keras.checks import refusal
from mpt_keras.keras_bridge.layer_calls import calls_before_cast
from mpt_keras.keras_bridge.layer_paths import iter_layers


@dataclasses.dataclass(frozen=True)
class NonfiniteReport:
    """Where a batch first stops being finite; None fields: nothing to say.

    `first_layer`: the first, in forward order, with a non-finite output; `input_max`,
    `output_max`, `weight_max`: its inputs' (before the cast; None for integer ids alone),
    outputs' and weights' largest finite magnitude, so that one reads which of them overflowed
    (an Embedding's ids say nothing, its table all); `inputs_finite`: False when it passed a
    non-finite input on. `first_nonfinite_gradient`:
    the first variable (`trainable_variables` order) with one, taken only after a finite
    forward pass. `loss`: scaled as a train step does.
    """

    first_layer: str | None = None
    compute_dtype: str | None = None
    input_max: float | None = None
    output_max: float | None = None
    inputs_finite: bool = True
    weight_max: float | None = None
    first_nonfinite_gradient: str | None = None
    loss: float | None = None

    @property
    def finite(self) -> bool:
        """Whether every output, the loss and every gradient were finite."""
        return (
            self.first_layer is None
            and self.first_nonfinite_gradient is None
            and (self.loss is None or math.isfinite(self.loss))
        )

    def summary(self) -> str:
        """One line: `first non-finite output: <path> (<dtype>), input max <x>, weight max <w>`
        (`no float input` for ids; no weights when the inputs were already non-finite), `first
        non-finite gradient: <path>` or `all outputs [and gradients] finite`, `, loss inf`."""
        if self.first_layer is not None:
            line = f"first non-finite output: {self.first_layer} ({self.compute_dtype}), "
            if self.input_max is not None:
                line += f"input max {self.input_max:.2g}"
            else:
                line += "no float input" if self.inputs_finite else "no finite input"
            if not self.inputs_finite:  # The cause lies upstream, not in its weights.
                return line + ", its inputs already non-finite"
            return line if self.weight_max is None else f"{line}, weight max {self.weight_max:.2g}"
        if self.first_nonfinite_gradient is not None:
            line = f"first non-finite gradient: {self.first_nonfinite_gradient}"
        elif self.loss is not None and self.finite:
            line = "all outputs and gradients finite"
        else:
            line = "all outputs finite"
        if self.loss is not None and not math.isfinite(self.loss):
            line += f", loss {self.loss:.2g}"
        return line

    def __str__(self) -> str:
        return self.summary()


def diagnose_nonfinite(
    model: keras.Model,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    loss: Callable[..., Any] | None = None,
) -> NonfiniteReport:
    """Runs one batch through `model` (eagerly, `training=False`), naming where it first
    stops being finite; the model is left as it was.

    With `y` and a finite forward pass, the gradients are checked too (traced), of `loss(y,
    y_pred, sample_weight=...)` unscaled if given, else of the train step's (compiled loss x
    `scale_loss`). `UserInputError`: `y` without `loss` or a compiled model.
    """
    if y is not None and loss is None and not model.compiled:
        raise refusal(
            "diagnose_nonfinite y",
            f"targets for model '{model.name}', which is not compiled (no loss to take "
            "gradients of)",
            "a compiled model, or loss=",
        )
    with _recorded_calls() as calls:
        model(x, training=False)
    paths = {id(model): model.name}
    for path, layer in iter_layers(model):
        paths.setdefault(id(layer), path)
    for call in calls:
        if not call.outputs.finite and id(call.layer) in paths:
            return NonfiniteReport(
                first_layer=paths[id(call.layer)],
                compute_dtype=call.layer.compute_dtype,
                input_max=call.inputs.max,
                output_max=call.outputs.max,
                inputs_finite=call.inputs.finite,
                weight_max=_largest_finite_weight(call.layer),
            )
    if y is None:
        return NonfiniteReport()
    variables = model.trainable_variables

    def loss_of(y_pred: Any) -> Any:
        if loss is not None:
            return loss(y, y_pred, sample_weight=sample_weight)
        value = compat.compute_loss(model, x, y, y_pred, sample_weight, training=True)
        scale_loss = getattr(model.optimizer, "scale_loss", None)
        return value if scale_loss is None else scale_loss(value)

    if current.is_jax():
        from mpt_keras.backend.jax.gradients import loss_and_gradients
    else:
        from mpt_keras.backend.tensorflow.gradients import loss_and_gradients
    value, gradients = loss_and_gradients(model, x, loss_of)
    first = next(
        (
            variable.path
            for variable, gradient in zip(variables, gradients)
            if gradient is not None and not _Range.of(gradient).finite
        ),
        None,
    )
    return NonfiniteReport(first_nonfinite_gradient=first, loss=float(value))


def describe_for_log(step: int, report: NonfiniteReport) -> str:
    """A diagnosis's log line: `step 412: first non-finite output: ...`."""
    return f"step {step}: {report.summary()}"


@dataclasses.dataclass(frozen=True)
class _Range:
    """A nest's floats: largest finite magnitude, whether all finite."""

    max: float | None
    finite: bool

    @classmethod
    def of(cls, nest: Any) -> _Range:
        largest, finite = None, True
        for value in map(_float_values, keras.tree.flatten(nest)):
            if value is None or not value.size:
                continue
            is_finite = np.isfinite(value)
            finite = finite and bool(is_finite.all())
            if is_finite.any():
                magnitude = float(np.max(np.abs(value[is_finite])))
                largest = magnitude if largest is None else max(largest, magnitude)
        return cls(largest, finite)


def _largest_finite_weight(layer: keras.layers.Layer) -> float | None:
    """The largest finite magnitude of `layer`'s float weights, reduced where they live: the
    layer may be a whole backbone, whose weights should not all travel to the host."""
    maxima = [
        keras.ops.max(keras.ops.where(keras.ops.isfinite(value), keras.ops.abs(value), -1.0))
        for value in (weight.value for weight in layer.weights)
        if keras.backend.is_float_dtype(keras.backend.standardize_dtype(value.dtype))
        and math.prod(value.shape)
    ]
    finite = [magnitude for magnitude in map(float, maxima) if magnitude >= 0]
    return max(finite) if finite else None


@dataclasses.dataclass(frozen=True)
class _Call:
    """One returned layer call: its inputs before the cast, and its outputs."""

    layer: keras.layers.Layer
    inputs: _Range
    outputs: _Range


@contextlib.contextmanager
def _recorded_calls() -> Iterator[list[_Call]]:
    """Records this thread's eager layer calls, in the order they return."""
    calls: list[_Call] = []

    def record(layer, args, kwargs, outputs) -> None:
        flat = keras.tree.flatten(outputs)
        if not any(isinstance(t, keras.KerasTensor) or current.is_traced(t) for t in flat):
            calls.append(_Call(layer, _Range.of((args, kwargs)), _Range.of(outputs)))

    with calls_before_cast(record):
        yield calls


def _float_values(value: Any) -> np.ndarray | None:
    """`value`'s floating values as a NumPy array (a ragged or sparse tensor's stored values,
    no densified zeros); None if it holds none."""
    if isinstance(value, (np.ndarray, np.generic, keras.Variable)):
        value = keras.ops.convert_to_tensor(value)
    if not current.is_jax():
        from mpt_keras.backend.tensorflow.values import dense_values

        value = dense_values(value)
    elif not keras.ops.is_tensor(value):
        value = None
    if value is None or not keras.backend.is_float_dtype(
        keras.backend.standardize_dtype(value.dtype)
    ):
        return None
    return np.asarray(keras.ops.convert_to_numpy(value))
