"""A batch skipped as bad data counts in neither the loss nor any metric.

Its loss is NaN and its predictions undefined (XLA's and TensorFlow's argmax of a NaN row
differ): a metric that took it would read NaN for the rest of the epoch, and a callback
(`TerminateOnNaN`, `EarlyStopping`) would act on a batch the optimizer skipped. Keras' step
updates the metrics as always; on a bad batch they are then put back as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops


class MetricsBefore:
    """TensorFlow: the model's metric variables read before its step updates them."""

    def __init__(self, model: keras.Model) -> None:
        from mpt_keras.backend.tensorflow.values import read_value

        self.variables = [v for metric in model.metrics for v in metric.variables]
        self.values = [read_value(v) for v in self.variables]

    def put_back_if(self, bad: Any) -> None:
        """Where `bad` (a bool tensor, or bool), the values read; in a trace, one `cond`."""
        from mpt_keras import compat

        def put_back() -> None:
            for variable, value in zip(self.variables, self.values):
                variable.assign(value)

        compat.called_cond(bad, put_back, lambda: None)


def kept_values(bad: Any, before: Sequence[Any], after: Sequence[Any]) -> list[Any]:
    """JAX: the metric values `before` the step where `bad`, else those `after` it."""
    return [ops.where(bad, old, new) for old, new in zip(before, after)]
