"""One replica's step, handed from its replica context to the cross-replica write.

A NamedTuple, not a dataclass: `merge_call` regroups a NamedTuple's fields over the replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class StepRecord(NamedTuple):
    """What the write of one step needs: `grads`, `accumulated` and `state` per replica; the
    rest, from all-reduced values, alike on every replica."""

    grads: list[Any]  # For the inner apply: unscaled, all-reduced (a window's mean).
    accumulated: list[Any]  # New values of the accumulation variables.
    state: list[Any]  # The forward pass's state before it: put back on a skip.
    should_apply: Any
    step_ends: Any  # The inner optimizer's step (with accumulation, the window) ends.
    finite: Any  # The rest as in `verdict.GradientVerdict`.
    halves: list[Any]
    new_values_finite: list[Any]
    bad_batch: Any
    loss: Any  # The global loss (0 when none was handed over).
    half_total: Any

    def shared(self, first_replica: Callable[[Any], Any]) -> StepRecord:
        """This record in the cross-replica context: the first replica's verdict speaks for all
        (`first_replica` of a per-replica value)."""
        return self._replace(
            **{
                name: first_replica(getattr(self, name))
                for name in self._fields
                if name not in _PER_REPLICA
            }
        )


_PER_REPLICA = ("grads", "accumulated", "state")
