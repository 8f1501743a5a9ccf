"""Tests of backend.tensorflow.checkpoints: save, restore, fall back past a bad checkpoint."""

import logging
import os

import keras
import numpy as np
import pytest

from mpt_keras.backend.tensorflow.checkpoints import Checkpointer, checkpoint_prefixes
from mpt_keras.errors import UserInputError
from mpt_keras.scaling.optimizer import LossScaleOptimizer


def _model_and_optimizer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=8.0)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def _save_three(model_dir):
    """Saves steps 1, 2, 3 with distinct weights and loss scales; returns the weights."""
    model, optimizer = _model_and_optimizer()
    checkpointer = Checkpointer(model_dir, model, optimizer, keep=5)
    saved = {}
    for step in (1, 2, 3):
        model.layers[0].kernel.assign(np.full((3, 2), float(step), "float32"))
        optimizer.dynamic_scale.assign(2.0**step)
        checkpointer.save(step)
        saved[step] = np.full((3, 2), float(step), "float32")
    return saved


def _restore(model_dir):
    model, optimizer = _model_and_optimizer()
    step = Checkpointer(model_dir, model, optimizer, keep=5).restore()
    return step, np.asarray(model.layers[0].kernel), optimizer.loss_scale


def _corrupt(prefix, suffix):
    (path,) = [
        os.path.join(os.path.dirname(prefix), name)
        for name in os.listdir(os.path.dirname(prefix))
        if name.startswith(os.path.basename(prefix) + suffix)
    ]
    size = os.path.getsize(path)
    with open(path, "r+b") as file:
        file.truncate(size // 2)


def test_restores_the_latest_checkpoint_with_weights_and_loss_scale(tmp_path):
    saved = _save_three(str(tmp_path))
    step, kernel, scale = _restore(str(tmp_path))
    assert (step, scale) == (3, 8.0)
    np.testing.assert_array_equal(kernel, saved[3])


def test_new_run_restores_nothing(tmp_path):
    assert _restore(str(tmp_path))[0] == 0


@pytest.mark.parametrize("suffix", [".data", ".index"])
def test_a_torn_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, suffix):
    saved = _save_three(str(tmp_path))
    _corrupt(os.path.join(tmp_path, "checkpoints", "step-3"), suffix)
    with caplog.at_level(logging.WARNING, logger="mpt_keras.checkpoint_files"):
        step, kernel, scale = _restore(str(tmp_path))
    assert (step, scale) == (2, 4.0)
    np.testing.assert_array_equal(kernel, saved[2])
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step-3 cannot be restored" in warning
    assert "trying the one before it" in warning


def test_checkpoints_are_found_without_the_state_file(tmp_path):
    _save_three(str(tmp_path))
    os.remove(os.path.join(tmp_path, "checkpoints", "checkpoint"))
    assert [os.path.basename(p) for p in checkpoint_prefixes(tmp_path / "checkpoints")] == [
        "step-3",
        "step-2",
        "step-1",
    ]
    assert _restore(str(tmp_path))[0] == 3


def test_no_readable_checkpoint_is_an_error_not_a_silent_restart(tmp_path):
    _save_three(str(tmp_path))
    for step in (1, 2, 3):
        _corrupt(os.path.join(tmp_path, "checkpoints", f"step-{step}"), ".index")
    with pytest.raises(UserInputError, match=r"none of its 3 checkpoints can be restored") as info:
        _restore(str(tmp_path))
    assert "\n" not in str(info.value)


def test_a_checkpoint_of_another_model_is_skipped(tmp_path):
    _save_three(str(tmp_path))
    keras.utils.set_random_seed(0)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.1))
    optimizer.build(other.trainable_variables)
    with pytest.raises(UserInputError, match="none of its 3 checkpoints"):
        Checkpointer(str(tmp_path), other, optimizer, keep=5).restore()
