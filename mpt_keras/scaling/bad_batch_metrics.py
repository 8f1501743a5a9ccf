"""A batch skipped as bad data counts in neither the loss nor any metric.

Its loss is NaN and its predictions undefined (XLA's and TensorFlow's argmax of a NaN row
differ): a metric that took it would read NaN for the rest of the epoch, and a callback
(`TerminateOnNaN`, `EarlyStopping`) would act on a batch the optimizer skipped. The step
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
        from mpt_keras.backend.tensorflow.cross_replica import current_graph
        from mpt_keras.backend.tensorflow.values import read_value

        self.metrics = list(model.metrics)
        self.values = [[read_value(v) for v in metric.variables] for metric in self.metrics]
        self.graph = current_graph()

    def readable(self, bad: Any) -> bool:
        """Whether `bad` can be read in the step these values were read in: not where a
        model's own step applied its gradients in a graph of its own (a `tf.cond`, a
        `tf.function`), whose tensors this graph cannot reach; its metrics then stay."""
        return getattr(bad, "graph", None) in (None, self.graph)

    def put_back_if(self, bad: Any) -> None:
        """Where `bad` (a bool tensor, or bool; if `readable`), the values read; in a trace,
        one `cond`."""
        if self.readable(bad):
            self._put_back_where(bad)

    def put_back_in_logs(self, bad: Any, logs: Any) -> Any:
        """`put_back_if(bad)`, and the step's `logs` (a dict) with it: each entry named after
        a metric the step updated (`metric.name`, or a name in a dict `result()` such as
        Keras' compile metrics) read again where `bad`. Any other entry stays as the step
        gave it: a model's own step may log a raw loss under the name of a metric it never
        updates."""
        if not isinstance(logs, dict):
            self.put_back_if(bad)
            return logs
        if not self.readable(bad):
            return logs
        updated = [
            self._updated(metric, values) for metric, values in zip(self.metrics, self.values)
        ]
        self._put_back_where(bad)
        logs = dict(logs)
        for metric, was_updated in zip(self.metrics, updated):
            if not getattr(metric, "built", True):  # Compile metrics the step never updates.
                continue
            result = metric.result()
            if not isinstance(result, dict):
                result = {metric.name: result}
            elif isinstance(logs.get(metric.name), dict):
                logs[metric.name] = _reread(logs[metric.name], result, bad & was_updated)
            logs = _reread(logs, result, bad & was_updated)
        return logs

    def _put_back_where(self, bad: Any) -> None:
        from mpt_keras import compat

        def put_back() -> None:
            for metric, values in zip(self.metrics, self.values):
                for variable, value in zip(metric.variables, values):
                    variable.assign(value)

        compat.called_cond(bad, put_back, lambda: None)

    @staticmethod
    def _updated(metric: keras.metrics.Metric, values: Sequence[Any]) -> Any:
        """Whether the step changed any of `metric`'s variables (a NaN it took counts)."""
        changed = [ops.any(ops.not_equal(v, old)) for v, old in zip(metric.variables, values)]
        return ops.any(ops.stack(changed)) if changed else ops.convert_to_tensor(False)


def _reread(logs: dict[str, Any], results: dict[str, Any], take: Any) -> dict[str, Any]:
    """`logs`, each entry `results` names (a tensor like it) taken from `results` where `take`."""
    kept = dict(logs)
    for name, result in results.items():
        logged = logs.get(name)
        if _alike(logged, result):
            kept[name] = ops.where(take, result, logged)
    return kept


def _alike(logged: Any, result: Any) -> bool:
    return (
        hasattr(logged, "dtype")
        and hasattr(result, "dtype")
        and logged.dtype == result.dtype
        and tuple(logged.shape) == tuple(result.shape)
    )


def kept_values(bad: Any, before: Sequence[Any], after: Sequence[Any]) -> list[Any]:
    """JAX: the metric values `before` the step where `bad`, else those `after` it."""
    return [ops.where(bad, old, new) for old, new in zip(before, after)]
