"""Tests of mpt_keras.reliability.guards: the callbacks' rules and the scaled learning rate."""

import types

import keras
import numpy as np
import pytest

from mpt_keras.errors import UserInputError
from mpt_keras.reliability.guards import (
    BadBatchLimit,
    Diverged,
    DivergenceGuard,
    ScaledLearningRate,
)


class _Optimizer:
    """What the guards read of a LossScaleOptimizer, settable per step."""

    def __init__(self):
        self.iterations = types.SimpleNamespace(numpy=lambda: 0)
        self.bad_batches = 0
        self.last_loss = 1.0


def _guard(patience, max_loss=None):
    guard = DivergenceGuard(patience, max_loss)
    guard.set_model(types.SimpleNamespace(optimizer=_Optimizer(), steps_per_execution=1))
    guard.on_train_begin()
    return guard


def _steps(guard, losses, bad_at=()):
    """Runs `losses` as an epoch's steps, after those already run."""
    guard.on_epoch_begin(0)
    for batch, loss in enumerate(losses):
        optimizer = guard.model.optimizer
        optimizer.last_loss = loss
        if batch in bad_at:
            optimizer.bad_batches += 1
        guard.on_train_batch_end(batch)


def test_divergence_needs_patience_bad_steps_in_a_row():
    guard = _guard(patience=3, max_loss=10.0)
    _steps(guard, [float("nan"), 11.0, 2.0, float("inf"), 12.0])
    assert guard.healthy() is False
    with pytest.raises(Diverged) as diverged:
        _steps(guard, [float("nan")])
    assert diverged.value.step == 6
    assert diverged.value.reason == (
        "the loss was non-finite or above 10 for 3 steps in a row (last: nan)"
    )


def test_bad_batches_neither_count_nor_break_a_streak():
    guard = _guard(patience=2)
    # The loss is not updated on a bad batch: its step is left out.
    _steps(guard, [float("nan"), float("nan"), 1.0], bad_at=(1,))
    assert guard.healthy()
    guard = _guard(patience=2)
    _steps(guard, [float("nan")])
    with pytest.raises(Diverged, match="non-finite for 2 steps"):
        _steps(guard, [float("nan"), float("nan")], bad_at=(0,))


def test_finite_losses_count_only_above_max_loss():
    guard = _guard(patience=1)
    _steps(guard, [1e30])
    assert guard.healthy()


def test_bad_batch_limit_needs_the_toolkits_optimizer():
    limit = BadBatchLimit(max_bad_batches=1)
    limit.set_model(types.SimpleNamespace(optimizer=keras.optimizers.SGD()))
    with pytest.raises(UserInputError) as error:
        limit.on_train_begin()
    assert str(error.value) == (
        "BadBatchLimit model.optimizer: received SGD. Allowed: mpt_keras.LossScaleOptimizer"
    )


@pytest.mark.parametrize(
    "base",
    [0.1, keras.optimizers.schedules.CosineDecay(0.1, decay_steps=10)],
    ids=["float", "schedule"],
)
def test_scaled_learning_rate_scales_and_round_trips(base):
    rate = ScaledLearningRate(base)
    before = float(rate(4))
    rate.scale.assign(0.25)
    np.testing.assert_allclose(float(rate(4)), before * 0.25, rtol=1e-6)
    again = ScaledLearningRate.from_config(rate.get_config())
    np.testing.assert_allclose(float(again(4)), before * 0.25, rtol=1e-6)
