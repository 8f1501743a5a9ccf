"""What the loss-scale optimizer reports (step logs, `StepHealth`), read from its variables."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from mpt_keras.backend import current
from mpt_keras.precision.float8 import largest_range_used
from mpt_keras.scaling.health import (
    BAD_BATCH_MEMORY,
    BAD_BATCHES,
    FLOAT8_RANGE_USED,
    GRADIENT_NORM,
    LOSS_SCALE,
    SKIPPED_STEPS,
    StepHealth,
)
from mpt_keras.scaling.own_variables import OwnVariables


def read(variable: keras.Variable, to_python: type) -> Any:
    """`variable` as a Python number eagerly; its tensor in a trace."""
    value = ops.convert_to_tensor(variable)
    if current.is_traced(value):
        return value
    # Not np.array(variable): NumPy 2 warns on Keras' Variable.__array__ (Keras' saving reads
    # these properties).
    return to_python(variable.numpy())


def gradient_norm(own: OwnVariables) -> Any:
    return ops.sqrt(2.0 * ops.convert_to_tensor(own.half_squared_norm))


def step_logs(own: OwnVariables) -> dict[str, Any]:
    """Float32 scalars under the `health` keys; `float8_range_used` with float8 layers."""
    logs = {
        LOSS_SCALE: ops.convert_to_tensor(own.scale.scale),
        SKIPPED_STEPS: ops.cast(own.skipped, "float32"),
        BAD_BATCHES: ops.cast(own.bad_batches, "float32"),
        GRADIENT_NORM: gradient_norm(own),
    }
    if own.model is not None:
        range_used = largest_range_used(own.model.variables)
        if range_used is not None:
            logs[FLOAT8_RANGE_USED] = range_used
    return logs


def health(own: OwnVariables) -> StepHealth:
    """The whole record, in one read (eagerly: it syncs with the device)."""
    count = int(own.bad_batches.numpy())
    ring = own.bad_batch_ring.numpy()
    first = max(0, count - BAD_BATCH_MEMORY)
    return StepHealth(
        loss_scale=float(own.scale.scale.numpy()),
        skipped_steps=int(own.skipped.numpy()),
        bad_batches=count,
        bad_batch_steps=tuple(int(ring[i % BAD_BATCH_MEMORY]) for i in range(first, count)),
        last_loss=float(own.last_loss.numpy()),
        gradient_norm=float(gradient_norm(own)),
        nonfinite_counts=nonfinite_counts(own),
    )


def nonfinite_counts(own: OwnVariables) -> dict[str, int]:
    """Per variable path, the steps whose gradient or update was non-finite (eagerly)."""
    if own.model is None:
        return {}
    counts = own.nonfinite.numpy()
    return {
        getattr(v, "path", v.name): int(counts[own.model.position(v)]) for v in own.model.variables
    }
