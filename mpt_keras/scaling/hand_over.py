"""What a train step hands the optimizer before `apply`: the loss, the batch, the state, and
whether it scaled its loss at all.

Keras' train step calls `scale_loss` but never passes the loss (or batch) to
`apply`; kept per replica and per trace, they let `apply` tell bad data from an overflow.
A model's own `train_step` written as Keras' guides write it never calls `scale_loss`:
`LossScaleSteps` lets `apply` see that, rather than divide unscaled gradients by the scale.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
from keras import ops

from mpt_keras import compat
from mpt_keras.backend import current
from mpt_keras.scaling import scale_rule

_LOGGER = logging.getLogger(__name__)

# The handed-over values that are tensors of the trace they were handed over in.
_TENSORS = ("loss", "batch", "state")


class HandOvers:
    """The values each replica's trace handed over, until its `apply` takes them."""

    def __init__(self) -> None:
        self._by_trace: dict[tuple[int, int], dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._by_trace)

    def put(self, **values: Any) -> None:
        key = _replica_trace_key()
        if any(other[0] != key[0] for other in self._by_trace):
            # Left by a trace that never reached `apply` (a `scale_loss` alone).
            self._by_trace = {k: v for k, v in self._by_trace.items() if k[0] == key[0]}
        self._by_trace.setdefault(key, {}).update(values)

    def take_unscaled(self) -> bool:
        """Whether this replica's trace unscaled its gradients itself (`get_unscaled_gradients`),
        taken alone: on JAX, a traced step's other values are the step function's arguments."""
        return self._by_trace.get(_replica_trace_key(), {}).pop("unscaled", False)

    def take(self) -> dict[str, Any]:
        """This replica's values in this trace (none from another graph's trace)."""
        values = self._by_trace.pop(_replica_trace_key(), {})
        if current.is_jax():  # Eager `apply` only: a JAX trace hands nothing over.
            return values
        from mpt_keras.backend.tensorflow.cross_replica import current_graph

        graph = current_graph()
        for name in _TENSORS:
            tensors = keras.tree.flatten(values.get(name))
            if any(getattr(t, "graph", graph) is not graph for t in tensors):
                values.pop(name)  # From a nested function's graph.
        return values


class StepVerdict:
    """What the `apply` of a model's train step judged: `bad`, whether it skipped the batch
    as bad data (a bool tensor), None until it runs."""

    def __init__(self) -> None:
        self.bad: Any = None


class LossScaleSteps:
    """Whether the model train step running in this thread (a replica's, on TensorFlow) has
    scaled its loss: outside one (a custom loop's `apply`), gradients count as scaled."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._told = False

    @contextlib.contextmanager
    def step(self, model_name: str) -> Iterator[StepVerdict]:
        """The train step of model `model_name` runs inside: `scaled` starts False; the
        verdict of its `apply` is given."""
        names = ("scaled", "model", "verdict")
        outer = [getattr(self._local, name, None) for name in names]
        self._local.scaled, self._local.model = False, model_name
        self._local.verdict = StepVerdict()
        try:
            yield self._local.verdict
        finally:
            for name, value in zip(names, outer):
                setattr(self._local, name, value)

    def judged(self, bad: Any) -> None:
        """`apply` skipped the step as a bad batch where `bad` (a bool tensor)."""
        verdict = getattr(self._local, "verdict", None)
        if verdict is not None:
            verdict.bad = bad

    def mark_scaled(self) -> None:
        if getattr(self._local, "scaled", None) is not None:
            self._local.scaled = True

    def check_readable(self, scale: keras.Variable, method: str) -> None:
        """On JAX, a model's train step must read `scale` through a `keras.StatelessScope` of
        the step's optimizer values: fit sets the variables' own values aside (and a compiled
        step would keep the value it was traced with)."""
        if not current.is_jax() or getattr(self._local, "scaled", None) is None:
            return
        if compat.stateless_value(scale) is None:
            raise ValueError(
                f"model '{self._local.model}': its train_step called optimizer.{method}() "
                "outside a keras.StatelessScope of the step's optimizer variables, where on JAX "
                "the loss scale has no value. Call it inside `with keras.StatelessScope("
                "state_mapping=list(zip(self.optimizer.variables, optimizer_variables))):`, "
                "as Keras' own compute_loss_and_updates does"
            )

    def never_scaled(self, optimizer: Any) -> bool:
        """In a model's train step that took gradients of a loss it never scaled, with
        `optimizer`'s scale not pinned at 1: they are not to be divided (warned once)."""
        if getattr(self._local, "scaled", None) is not False or scale_rule.scale_is_one(optimizer):
            return False
        if not self._told:
            self._told = True
            _LOGGER.warning(
                "model '%s': its train_step applied gradients of a loss it never scaled (no "
                "optimizer.scale_loss(loss) before taking them): %s applies them as they "
                "are, not divided by the loss scale, so small float16 gradients may "
                "underflow to zero. Scale the loss before taking gradients, as Keras' own "
                "train_step does: loss = self.optimizer.scale_loss(loss)",
                self._local.model,
                type(optimizer).__name__,
            )
        return True


def state_before(variables: Sequence[keras.Variable]) -> list[tuple[keras.Variable, Any]]:
    """The floating `variables` with a copy of their values now, for `apply(state=...)`."""
    floating = [v for v in variables if keras.backend.is_float_dtype(v.dtype)]
    if current.is_jax():
        return [(v, ops.copy(v.value)) for v in floating]
    from mpt_keras.backend.tensorflow.values import copied_value

    return [(v, copied_value(v)) for v in floating]


def _replica_trace_key() -> tuple[int, int]:
    """This replica in this trace (on JAX, where only an eager `apply` takes hand-overs: one)."""
    if current.is_jax():
        return (0, 0)
    from mpt_keras.backend.tensorflow.cross_replica import replica_trace_key

    return replica_trace_key()
