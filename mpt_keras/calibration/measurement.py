"""Calibration's passes after the recording pass: gradients, each group's low-precision
output errors, and the diagnosis of a non-finite batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from mpt_keras.backend import current
from mpt_keras.calibration.float8 import Float8Recorder
from mpt_keras.calibration.sites import CalibrationSites, Group, flat_float32
from mpt_keras.calibration.statistics import OutputErrors, VariableGradients, variable_gradients
from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import is_float8_state
from mpt_keras.precision.names import LOW_PRECISION_POLICIES
from mpt_keras.telemetry.diagnosis import diagnose_nonfinite

# (x, y, sample_weight or None)
Batch = tuple[Any, Any, Any]


def gradient_statistics(
    model: keras.Model,
    sites: CalibrationSites,
    recorder: Float8Recorder,
    batches: Sequence[Batch],
    loss: Callable[..., Any],
    scale: float,
) -> dict[str, VariableGradients]:
    """Per trainable variable path, its gradient's figures; `recorder` records the same pass.

    On TensorFlow one taped pass gives both; on JAX a recorded eager pass, then `jax.grad`
    through `stateless_call` with a zero added to each recorded matmul output (its gradient
    is the output's).
    """
    owners = {}
    for site in reversed(sites.sites):  # A variable's owner is its innermost site.
        for variable in site.layer.trainable_variables:
            owners.setdefault(id(variable), site.path)
    # A float8 layer's scales and amax histories have no gradient (a step overwrites them).
    variables = [v for v in model.trainable_variables if not is_float8_state(v)]
    pieces = [[] for _ in variables]
    if current.is_jax():
        from mpt_keras.backend.jax.gradients import recorded_gradients
    else:
        from mpt_keras.backend.tensorflow.gradients import recorded_gradients
    for batch in batches:
        gradients, output_gradients = recorded_gradients(model, recorder, variables, loss, *batch)
        recorder.add_batch(output_gradients)
        for index, gradient in enumerate(gradients):
            if gradient is not None:
                pieces[index].append(np.abs(keras.ops.convert_to_numpy(gradient)).ravel())
    return {
        variable.path: variable_gradients(
            owners.get(id(variable)),
            np.concatenate(magnitudes) if magnitudes else np.zeros(0),
            scale,
        )
        for variable, magnitudes in zip(variables, pieces)
    }


def output_errors(group: Group) -> OutputErrors:
    """The group's `OutputErrors`, its members alone in each low precision."""
    references = group.called.outputs()
    return OutputErrors(
        **{policy: _error(group, policy, references) for policy in LOW_PRECISION_POLICIES}
    )


def _error(group: Group, policy: str, references: list[np.ndarray]) -> float:
    # The rest is float32 already (the caller applied a float32 manifest).
    members = [member.layer for member in group.members]
    for layer in members:
        layer.dtype_policy = policy
    try:
        squared_error = squared_reference = 0.0
        for (args, kwargs, _), reference in zip(group.called.calls, references):
            low = flat_float32(keras.tree.flatten(group.called.layer(*args, **kwargs)))
            squared_error += float(np.sum(np.square(low - reference, dtype=np.float64)))
            squared_reference += float(np.sum(np.square(reference, dtype=np.float64)))
    finally:
        for layer in members:
            layer.dtype_policy = "float32"
    if not math.isfinite(squared_error):
        return squared_error  # inf, or nan
    return math.sqrt(squared_error / squared_reference) if squared_reference else 0.0


def diagnosis(
    model: keras.Model,
    sites: CalibrationSites,
    batches: Sequence[Batch],
    loss: Callable[..., Any],
    gradients: dict[str, VariableGradients],
) -> str | None:
    """Where the first batch with non-finite float32 gradients stopped being finite.

    Returns `statistics batch <n> of <steps>: first non-finite gradient: <path>`
    (`diagnose_nonfinite`), or None when all were finite.

    Raises:
        UserInputError: If a layer's output was not finite: no precision mends it.
    """
    outputs_finite = all(
        np.isfinite(output).all() for site in sites.sites for output in site.outputs()
    )
    if outputs_finite and all(math.isfinite(figures.max) for figures in gradients.values()):
        return None
    for index, (features, labels, sample_weight) in enumerate(batches):
        report = diagnose_nonfinite(model, features, labels, sample_weight, loss=loss)
        batch = f"statistics batch {index + 1} of {len(batches)}"
        if report.first_layer is not None:
            raise UserInputError(
                f"{batch} is not finite in float32: {report}. "
                "Allowed: a model and data whose float32 outputs are finite"
            )
        if not report.finite:
            return f"{batch}: {report}"
    return None
