"""Checkpoints as NumPy files (`reliability/array_checkpoints.py`), on either backend: a run
killed after a checkpoint and resumed in a fresh model ends where an uninterrupted one does."""

import logging
import os

import keras
import numpy as np
import pytest

from mpt_keras.errors import UserInputError
from mpt_keras.reliability.array_checkpoints import ArrayCheckpointer, checkpoint_files
from mpt_keras.scaling.optimizer import LossScaleOptimizer

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 4, 3)).astype(np.float32)  # Four batches of two.
Y = RNG.integers(0, 3, size=(8, 4)).astype(np.int32)


def _model(width: int = 5) -> keras.Model:
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(width, activation="relu", kernel_initializer="ones")(inputs)
    normalized = keras.layers.BatchNormalization()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3, kernel_initializer="ones")(normalized))
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=2.0**4)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.build((None, 3))
    optimizer.build(model.trainable_variables)
    return model


def _train(model: keras.Model, steps: range) -> None:
    for step in steps:
        model.train_on_batch(X[step], Y[step])


def _state(model: keras.Model) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v) for v in (*model.variables, *model.optimizer.variables)]


def _checkpointer(model_dir: str, model: keras.Model, keep: int = 2) -> ArrayCheckpointer:
    return ArrayCheckpointer(str(model_dir), model, model.optimizer, keep=keep)


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    whole = _model()
    _train(whole, range(4))
    first = _model()
    _train(first, range(2))
    _checkpointer(tmp_path, first).save(2)
    _train(first, range(2, 3))  # Lost with the kill: no checkpoint after it.
    resumed = _model()
    assert _checkpointer(tmp_path, resumed).restore() == 2
    _train(resumed, range(2, 4))
    for ours, theirs in zip(_state(resumed), _state(whole), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert int(keras.ops.convert_to_numpy(resumed.optimizer.iterations)) == 4


def test_only_the_newest_are_kept_and_a_torn_one_is_skipped_with_a_warning(tmp_path, caplog):
    model = _model()
    checkpointer = _checkpointer(tmp_path, model, keep=2)
    for step in (1, 2, 3):
        _train(model, range(step - 1, step))
        checkpointer.save(step)
    files = checkpoint_files(str(tmp_path / "checkpoints"))
    assert [os.path.basename(path) for path in files] == ["step-3.npz", "step-2.npz"]
    with open(files[0], "r+b") as file:
        file.truncate(100)  # Torn by something other than our rename (a full disk).
    with caplog.at_level(logging.WARNING):
        assert _checkpointer(tmp_path, _model()).restore() == 2
    assert "step-3.npz cannot be restored" in caplog.text


def test_no_checkpoint_is_step_0_and_none_readable_is_one_line(tmp_path):
    assert _checkpointer(tmp_path, _model()).restore() == 0
    _checkpointer(tmp_path, _model(width=5)).save(1)
    with pytest.raises(UserInputError) as raised:
        _checkpointer(tmp_path, _model(width=6)).restore()
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'checkpoints'}: none of its 1 checkpoints can be ")
    assert "has shape (3, 5) there, (3, 6) here" in message
    assert message.endswith("move the directory away to start over") and "\n" not in message
