"""Activation and gradient magnitudes on a sample batch, against the float16 range.

Written every `histogram_freq` steps from a pass on a fixed batch: callbacks do not see the
train data. The pass traces the model with TensorFlow (`backend/tensorflow/gradients.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from mpt_keras.backend.tensorflow.gradients import traced_value_and_gradients
from mpt_keras.precision.float8 import is_float8_state
from mpt_keras.precision.limits import FLOAT16_MAX, FLOAT16_SMALLEST_NORMAL
from mpt_keras.telemetry import layout as tags

SamplePass = Callable[[Any, Any], tuple[dict[str, Any], dict[str, Any]]]


def sample_pass(model: keras.Model) -> SamplePass:
    """A traced `(x, y) -> (activations, gradients)`, each by name.

    Activations: the top-level layers' outputs (none if subclassed). Gradients: of the scaled
    loss, as a train step's, without float8 scales and amax histories (their "gradients" are
    new values).
    """
    probe = _activation_probe(model)

    def scaled_loss_and_activations(x: Any, y: Any) -> tuple[Any, dict[str, Any]]:
        if probe is None:
            prediction, activations = model(x, training=False), {}
        else:
            outputs = probe(x, training=False)
            prediction, activations = outputs["prediction"], outputs["activations"]
        loss = model.compute_loss(x=x, y=y, y_pred=prediction, training=False)
        return model.optimizer.scale_loss(loss), activations

    def trainable() -> list[keras.Variable]:
        return [v for v in model.trainable_variables if not is_float8_state(v)]

    run = traced_value_and_gradients(scaled_loss_and_activations, trainable)

    def activations_and_gradients(x: Any, y: Any):
        _, activations, gradients = run(x, y)
        named = {
            variable.path: gradient
            for variable, gradient in zip(trainable(), gradients)
            if gradient is not None
        }
        return activations, named

    return activations_and_gradients


def write_sample_statistics(
    files: Any, step: int, activations: dict[str, Any], gradients: dict[str, Any]
) -> None:
    """Writes each tensor's magnitudes at `step` in `files`' `train` writer (a summary writer
    of `monitor.summary_files`)."""
    for kind, values in ((tags.ACTIVATION, activations), (tags.GRADIENT, gradients)):
        for name, value in values.items():
            _write_magnitudes(files, step, kind, name, value)


def _activation_probe(model: keras.Model) -> keras.Model | None:
    """A model returning the prediction and top-level layers' outputs; None if subclassed."""
    if not getattr(model, "inputs", None):
        return None
    activations = {
        layer.name: layer.output
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
        and isinstance(layer.output, keras.KerasTensor)
    }
    # `inputs`, `outputs`: a Sequential model has no `input`, `output`.
    return keras.Model(
        _single_or_list(model.inputs),
        {"prediction": _single_or_list(model.outputs), "activations": activations},
    )


def _single_or_list(tensors: list[keras.KerasTensor]) -> keras.KerasTensor | list:
    return tensors[0] if len(tensors) == 1 else tensors


def _write_magnitudes(files: Any, step: int, kind: str, name: str, value: Any) -> None:
    """Shares above float16's max and below its smallest normal, and log2|x|."""
    # Dense: an embedding's gradient comes as slices.
    dense = keras.ops.convert_to_tensor(value)
    magnitude = np.abs(keras.ops.convert_to_numpy(dense).astype(np.float32).reshape(-1))
    # NaN compares false, so `not <= max` counts it as overflowed.
    above = ~(magnitude <= FLOAT16_MAX)
    below = (magnitude > 0) & (magnitude < FLOAT16_SMALLEST_NORMAL)
    files.scalar("train", step, kind + tags.ABOVE_FLOAT16_MAX + name, _fraction(above))
    files.scalar("train", step, kind + tags.BELOW_FLOAT16_NORMAL + name, _fraction(below))
    loggable = magnitude[(magnitude > 0) & np.isfinite(magnitude)]
    files.histogram("train", step, kind + tags.LOG2_MAGNITUDE + name, np.log2(loggable))


def _fraction(mask: np.ndarray) -> float:
    return float(np.mean(mask)) if mask.size else float("nan")
