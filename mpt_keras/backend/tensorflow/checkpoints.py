"""Checkpoints that a rerun on the same `model_dir` resumes from.

A checkpoint holds the model's (float32 master) weights, the optimizer's state
(loss scale and counters included) and the number of train steps done. The data
position needs no state of its own: the train stream is a pure function of the
seed and the step (see `mpt_keras.data.pipeline`), so the step restores it.

TensorFlow writes a checkpoint's shards to a temporary name and merges them
into place, then records it in the `checkpoint` state file, so a process
killed while saving leaves the previous checkpoints intact. A checkpoint that
is torn or corrupted anyway (a truncated file, a bad disk) is skipped on
restore with a warning, and the one before it restored.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping

import keras
import tensorflow as tf

from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.callbacks import GlobalStepCallback

CHECKPOINT_SUBDIR = "checkpoints"
_PREFIX = "step"
# What reading a torn or foreign checkpoint raises (a truncated data file:
# IndexError from the checkpoint reader; a truncated index: DataLossError).
_UNREADABLE = (tf.errors.OpError, ValueError, AssertionError, IndexError, KeyError)
_INDEX_FILE = re.compile(rf"^{_PREFIX}-(\d+)\.index$")
_LOGGER = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores the training state under `model_dir/checkpoints`.

    Args:
        model_dir: The run's directory: restores from its `checkpoints`.
        model: The model; built, so that its variables exist.
        optimizer: The optimizer; built on the model's trainable variables.
        keep: How many of the latest checkpoints to keep.
        write_dir: Where to save, if not `model_dir`: a multi-worker run's
            non-chief workers take part in saving into a directory of their
            own (see `distribute.worker_write_dir`).
        extra_variables: More variables to save, by name (e.g. the learning
            rate scale of a divergence rollback).

    Example:

        checkpointer = Checkpointer(model_dir, model, model.optimizer, keep=3)
        step = checkpointer.restore()   # 0 for a new run
        ...
        checkpointer.save(step)
    """

    def __init__(
        self,
        model_dir: str,
        model: keras.Model,
        optimizer: keras.Optimizer,
        keep: int,
        write_dir: str | None = None,
        extra_variables: Mapping[str, tf.Variable | keras.Variable] | None = None,
    ):
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # The variables, not the objects: tf.train.Checkpoint does not track a
        # Keras 3 model's variables (only the optimizer's references to the
        # trainable ones), which would lose non-trainable state such as
        # normalization statistics and dropout seeds. Listed in their (stable)
        # creation order: their paths carry auto-generated name suffixes that
        # depend on what else the process has built.
        self._checkpoint = tf.train.Checkpoint(
            model=list(model.variables),
            optimizer=list(optimizer.variables),
            step=self._step,
            **{
                name: getattr(variable, "value", variable)
                for name, variable in (extra_variables or {}).items()
            },
        )
        self._restore_dir = os.path.join(model_dir, CHECKPOINT_SUBDIR)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint,
            directory=os.path.join(write_dir or model_dir, CHECKPOINT_SUBDIR),
            max_to_keep=keep,
            checkpoint_name=_PREFIX,
        )

    def restore(self) -> int:
        """Restores the latest readable checkpoint, if any.

        Checkpoints are tried newest first; one that cannot be read (torn,
        corrupted, or of another model) is skipped with a warning.

        Returns:
            The number of train steps the restored checkpoint had done; 0 if
            there is no checkpoint.

        Raises:
            UserInputError: If there are checkpoints and none can be read.
        """
        candidates = checkpoint_prefixes(self._restore_dir)
        problems = []
        for prefix in candidates:
            try:
                self._checkpoint.restore(prefix).assert_existing_objects_matched()
            except _UNREADABLE as error:
                reason = _first_line(error)
                problems.append(reason)
                _LOGGER.warning(
                    "Checkpoint %s cannot be restored (%s): trying the one before it.",
                    prefix,
                    reason,
                )
                continue
            step = int(self._step.numpy())
            _LOGGER.info("Resumed from %s at step %d.", prefix, step)
            return step
        if candidates:
            raise UserInputError(
                f"{self._restore_dir}: none of its {len(candidates)} checkpoints can be "
                f"restored (the latest: {problems[0]}); move the directory away to start over"
            )
        return 0

    def save(self, step: int) -> str:
        """Saves the state after `step` train steps; returns the checkpoint path."""
        self._step.assign(step)
        return self._manager.save(checkpoint_number=step)


def checkpoint_prefixes(directory: str) -> list[str]:
    """The checkpoints in `directory` (their path prefixes), newest first.

    Read from the files themselves rather than the `checkpoint` state file, so
    a checkpoint the state file does not list is still found.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = sorted(
        (int(match.group(1)) for match in map(_INDEX_FILE.match, names) if match), reverse=True
    )
    return [os.path.join(directory, f"{_PREFIX}-{step}") for step in steps]


def _first_line(error: Exception) -> str:
    text = str(getattr(error, "message", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class SaveCheckpoints(GlobalStepCallback):
    """Saves a checkpoint at the end of every Keras epoch of `model.fit`.

    `run_training` makes one Keras epoch one checkpoint interval, so this saves
    every `checkpoint_every` steps and at the run's last step.

    Args:
        checkpointer: Where to save.
        healthy: Whether the run is in a state worth saving; if it returns
            False, the save is skipped (with a warning) and the previous
            checkpoints stay the latest. `None`: always save.
    """

    def __init__(self, checkpointer: Checkpointer, healthy: Callable[[], bool] | None = None):
        super().__init__()
        self._checkpointer = checkpointer
        self._healthy = healthy

    def on_epoch_end(self, epoch, logs=None):
        if self._healthy is not None and not self._healthy():
            _LOGGER.warning(
                "Step %d: the loss is unhealthy, no checkpoint saved.", self.global_step
            )
            return
        path = self._checkpointer.save(self.global_step)
        _LOGGER.info("Step %d: saved %s.", self.global_step, path)
