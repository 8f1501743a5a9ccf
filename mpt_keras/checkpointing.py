"""Checkpoints that a rerun on the same `model_dir` resumes from.

A checkpoint holds the model's (float32 master) weights, the optimizer's state
(loss scale and counters included) and the number of train steps done. The data
position needs no state of its own: the train stream is a pure function of the
seed and the step (see `mpt_keras.data.pipeline`), so the step restores it.
"""

from __future__ import annotations

import logging
import os

import keras
import tensorflow as tf

from mpt_keras.callbacks import GlobalStepCallback

CHECKPOINT_SUBDIR = "checkpoints"
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
        )
        self._restore_dir = os.path.join(model_dir, CHECKPOINT_SUBDIR)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint,
            directory=os.path.join(write_dir or model_dir, CHECKPOINT_SUBDIR),
            max_to_keep=keep,
            checkpoint_name="step",
        )

    def restore(self) -> int:
        """Restores the latest checkpoint, if any; returns the steps it had done."""
        latest = tf.train.latest_checkpoint(self._restore_dir)
        if latest is None:
            return 0
        self._checkpoint.restore(latest).assert_existing_objects_matched()
        step = int(self._step.numpy())
        _LOGGER.info("Resumed from %s at step %d.", latest, step)
        return step

    def save(self, step: int) -> str:
        """Saves the state after `step` train steps; returns the checkpoint path."""
        self._step.assign(step)
        return self._manager.save(checkpoint_number=step)


class SaveCheckpoints(GlobalStepCallback):
    """Saves a checkpoint at the end of every Keras epoch of `model.fit`.

    `run_training` makes one Keras epoch one checkpoint interval, so this saves
    every `checkpoint_every` steps and at the run's last step.

    Args:
        checkpointer: Where to save.
    """

    def __init__(self, checkpointer: Checkpointer):
        super().__init__()
        self._checkpointer = checkpointer

    def on_epoch_end(self, epoch, logs=None):
        path = self._checkpointer.save(self.global_step)
        _LOGGER.info("Step %d: saved %s.", self.global_step, path)
