"""Diagnosis: the first layer whose output is not finite, or the first non-finite gradient.

When a float16 step overflows, the loss scale says that it did, not where.
`diagnose_nonfinite(model, x, y)` runs one batch through the model eagerly
(`model(x, training=False)`) and records every layer's call as it returns,
nested layers and models included (a layer inside a layer, a functional model
inside a Sequential, a keras_hub backbone). Each layer is named by its path
from the model (`mpt_keras.keras_bridge.layer_paths`), the path a manifest rule matches.

Forward order is the order the outputs are made: a layer's sublayers return
before it does, so the layer named is the innermost one that first made an
inf or NaN. Its inputs are recorded as the layer was called, before Keras
casts them to its compute dtype: a float32 output too large for float16 names
the float16 layer it feeds, with an input max above 65504. When the inputs of
the layer named were already not finite (a bad batch, or an operation outside
any layer made them), the summary says so. When no layer's output but the
model's is not finite, the model's own code made it, and the model's name is
given.

When the forward pass is finite and `y` is given, the gradients of the loss
are taken as a train step takes them: the compiled loss (`model.compute_loss`)
times the optimizer's loss scale (`scale_loss`). The variable named is the
first, in `model.trainable_variables` order, whose gradient is not finite.

While the batch runs, `keras.layers.Layer.__call__` is wrapped: in this
thread, each call of the model's layers is recorded. It is put back when the
forward pass ends, also if it raises; nothing on the layers themselves is
changed. One diagnosis runs at a time.

Example:

    report = diagnose_nonfinite(model, features, labels)
    report.first_layer      # 'block_1/mlp/dense'
    print(report)           # first non-finite output: block_1/mlp/dense (float16),
                            # input max 7.1e+04
    describe_for_log(412, report)   # 'step 412: first non-finite output: ...'
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras import compat
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers

# One diagnosis at a time: each wraps and puts back the one `Layer.__call__`.
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class NonfiniteReport:
    """Where a batch first stops being finite; see the module docstring.

    Attributes:
        first_layer: The path of the first layer, in forward order, whose
            output has an inf or NaN (the model's name if only its own code
            made one); None when every output is finite.
        compute_dtype: That layer's compute dtype (`float16`).
        input_max: The largest finite magnitude of its floating-point inputs,
            as it was called (before the cast to its compute dtype); None if
            it has none.
        output_max: The largest magnitude among its finite outputs; None if
            none is finite.
        inputs_finite: Whether all its inputs were finite; when not, it
            passed on a non-finite value rather than made one.
        first_nonfinite_gradient: The path of the first trainable variable
            whose gradient is not finite; None when all are, when the
            forward pass is not finite, or when no gradient was taken.
        loss: The loss the gradients were taken of, scaled as the train step
            scales it; None when no gradient was taken.

    Example:

        report = diagnose_nonfinite(model, features)
        report.first_layer, report.compute_dtype, report.input_max
        # ('boom', 'float16', 8.0)
        str(report)  # 'first non-finite output: boom (float16), input max 8'
    """

    first_layer: str | None = None
    compute_dtype: str | None = None
    input_max: float | None = None
    output_max: float | None = None
    inputs_finite: bool = True
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
        """One line: what was first not finite, or that all was.

        Returns:
            `first non-finite output: <path> (<dtype>), input max <x>`,
            `first non-finite gradient: <path>`, `all outputs finite` or
            `all outputs and gradients finite`; a non-finite loss is added
            (`, loss inf`).
        """
        if self.first_layer is not None:
            line = f"first non-finite output: {self.first_layer} ({self.compute_dtype}), "
            line += (
                "no finite input" if self.input_max is None else f"input max {self.input_max:.2g}"
            )
            return line + ("" if self.inputs_finite else ", its inputs already non-finite")
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
    """Runs one batch through `model` and names where it first stops being finite.

    Args:
        model: A Keras model, functional, Sequential or subclassed, with any
            dtype policies. Its weights, policies and layers are left as they
            were.
        x: The batch's inputs, as the model takes them.
        y: The batch's targets. When given and the forward pass is finite,
            the gradients are checked too.
        sample_weight: The batch's sample weights, or None.
        loss: Taken the gradients of instead of the train step's loss: called
            as `loss(y, y_pred, sample_weight=sample_weight)` and not scaled
            (a `keras.losses.Loss`). By default, the compiled loss
            (`model.compute_loss`) times the optimizer's loss scale
            (`model.optimizer.scale_loss`), as a train step takes it.

    Returns:
        The report. The model runs with `training=False` (no dropout; batch
        normalization on its moving statistics), eagerly, once, and once more
        in a `tf.function`, under a gradient tape, when gradients are checked.

    Raises:
        UserInputError: If `y` is given, but neither `loss` nor a compiled
            model to take the loss from.
    """
    if y is not None and loss is None and not model.compiled:
        raise UserInputError(
            f"diagnose_nonfinite: received y, but model '{model.name}' is not compiled, so it "
            "has no loss to take gradients of. Compile the model, or pass loss="
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
            )
    if y is None:
        return NonfiniteReport()
    variables = model.trainable_variables

    # In a function: Keras' float8 layers take no gradient eagerly (3.15.1).
    @tf.function(autograph=False)
    def loss_and_gradients(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=False)
            if loss is None:
                value = compat.compute_loss(model, x, y, y_pred, sample_weight, training=True)
                scale_loss = getattr(model.optimizer, "scale_loss", None)
                if scale_loss is not None:
                    value = scale_loss(value)
            else:
                value = loss(y, y_pred, sample_weight=sample_weight)
        return value, tape.gradient(value, variables)

    value, gradients = loss_and_gradients(x, y, sample_weight)
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
    """The log line of a diagnosis at a training step.

    Args:
        step: The training step the batch was diagnosed at.
        report: What `diagnose_nonfinite` found.

    Returns:
        One line: `step 412: first non-finite output: block_1/mlp/dense
        (float16), input max 7.1e+04`.
    """
    return f"step {step}: {report.summary()}"


@dataclasses.dataclass(frozen=True)
class _Range:
    """The floating-point values of a nest of tensors: largest finite magnitude, all finite."""

    max: float | None
    finite: bool

    @classmethod
    def of(cls, nest: Any) -> _Range:
        largest, finite = None, True
        for value in map(_values, keras.tree.flatten(nest)):
            if value is None or not value.dtype.is_floating or not tf.size(value):
                continue
            is_finite = tf.math.is_finite(value)
            finite = finite and bool(tf.reduce_all(is_finite))
            if bool(tf.reduce_any(is_finite)):
                magnitude = float(tf.reduce_max(tf.where(is_finite, tf.abs(value), 0)))
                largest = magnitude if largest is None else max(largest, magnitude)
        return cls(largest, finite)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a layer, as it returned: its inputs before the cast and its outputs."""

    layer: keras.layers.Layer
    inputs: _Range
    outputs: _Range


@contextlib.contextmanager
def _recorded_calls() -> Iterator[list[_Call]]:
    """Records the eager calls of layers made in this thread, in the order they return.

    `Layer.__call__` is put back as it was when the body ends, also if it raises.
    """
    layer_class = keras.layers.Layer
    original = vars(layer_class)["__call__"]
    thread = threading.get_ident()
    calls: list[_Call] = []

    @functools.wraps(original)
    def recording_call(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        if (
            threading.get_ident() == thread
            and tf.executing_eagerly()
            and not any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(outputs))
        ):
            calls.append(_Call(self, _Range.of((args, kwargs)), _Range.of(outputs)))
        return outputs

    with _LOCK:
        layer_class.__call__ = recording_call
        try:
            yield calls
        finally:
            layer_class.__call__ = original


def _values(value: Any) -> tf.Tensor | None:
    """`value`'s values as a dense tensor, or None if it holds none (not an array or tensor)."""
    if isinstance(value, (tf.SparseTensor, tf.IndexedSlices)):
        return value.values
    if isinstance(value, tf.RaggedTensor):
        return value.flat_values
    if isinstance(value, (np.ndarray, np.generic, keras.Variable)) or tf.is_tensor(value):
        return tf.convert_to_tensor(value)
    return None
