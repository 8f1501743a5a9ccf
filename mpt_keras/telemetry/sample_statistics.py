"""Activation and gradient magnitudes on a sample batch, against the float16 range.

Written every `histogram_freq` steps from a pass on a fixed batch: callbacks do not see the
train data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpt_keras.precision.float8 import is_float8_state
from mpt_keras.precision.limits import FLOAT16_MAX, FLOAT16_SMALLEST_NORMAL
from mpt_keras.telemetry import layout as tags

SamplePass = Callable[[Any, Any], tuple[dict[str, tf.Tensor], dict[str, tf.Tensor]]]


def sample_pass(model: keras.Model) -> SamplePass:
    """A traced `(x, y) -> (activations, gradients)`, each by name.

    Activations: the top-level layers' outputs (none if subclassed). Gradients: of the scaled
    loss, as a train step's, without float8 scales and amax histories (their "gradients" are
    new values). Traced: Keras' float8 layers take no gradient eagerly.
    """
    probe = _activation_probe(model)

    @tf.function
    def activations_and_gradients(x: Any, y: Any):
        trainable = [
            variable for variable in model.trainable_variables if not is_float8_state(variable)
        ]
        with tf.GradientTape() as tape:
            if probe is None:
                prediction, activations = model(x, training=False), {}
            else:
                outputs = probe(x, training=False)
                prediction, activations = outputs["prediction"], outputs["activations"]
            loss = model.compute_loss(x=x, y=y, y_pred=prediction, training=False)
            scaled_loss = model.optimizer.scale_loss(loss)
        gradients = {
            variable.path: gradient
            for variable, gradient in zip(trainable, tape.gradient(scaled_loss, trainable))
            if gradient is not None
        }
        return activations, gradients

    return activations_and_gradients


def write_sample_statistics(
    activations: dict[str, tf.Tensor], gradients: dict[str, tf.Tensor]
) -> None:
    """Writes each tensor's magnitudes with the default summary writer and step."""
    for kind, values in ((tags.ACTIVATION, activations), (tags.GRADIENT, gradients)):
        for name, value in values.items():
            _write_magnitudes(kind, name, value)


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


def _write_magnitudes(kind: str, name: str, value: Any) -> None:
    """Shares above float16's max and below its smallest normal, and log2|x|."""
    magnitude = tf.abs(tf.reshape(tf.cast(tf.convert_to_tensor(value), tf.float32), [-1]))
    # NaN compares false, so `not <= max` counts it as overflowed.
    above = ~(magnitude <= FLOAT16_MAX)
    below = (magnitude > 0) & (magnitude < FLOAT16_SMALLEST_NORMAL)
    tf.summary.scalar(kind + tags.ABOVE_FLOAT16_MAX + name, _fraction(above))
    tf.summary.scalar(kind + tags.BELOW_FLOAT16_NORMAL + name, _fraction(below))
    loggable = tf.boolean_mask(magnitude, (magnitude > 0) & tf.math.is_finite(magnitude))
    tf.summary.histogram(kind + tags.LOG2_MAGNITUDE + name, tf.math.log(loggable) / np.log(2.0))


def _fraction(mask: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.cast(mask, tf.float32))
