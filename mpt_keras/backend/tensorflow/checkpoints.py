"""Checkpoints (weights, optimizer state, steps done: the data position too) a rerun on the
same `model_dir` resumes from; a torn one is skipped."""

from __future__ import annotations

import os
from collections.abc import Mapping

import keras
import tensorflow as tf

from mpt_keras.checkpoint_files import (
    CHECKPOINT_SUBDIR,
    PREFIX,
    newest_first,
    restore_newest,
)

# Raised reading a torn or foreign checkpoint.
_UNREADABLE = (tf.errors.OpError, ValueError, AssertionError, IndexError, KeyError)


class Checkpointer:
    """Saves and restores the training state under `model_dir/checkpoints`.

    `model`, `optimizer`: built. `write_dir`: a non-chief worker's, else `model_dir`.
    `extra_variables`: more, by name (e.g. a rollback's learning rate scale).
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
        # Variables, not objects: tf.train.Checkpoint misses a Keras 3 model's non-trainable
        # ones. In (stable) creation order: their paths carry process-dependent suffixes.
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
            checkpoint_name=PREFIX,
        )

    def restore(self) -> int:
        """Restores the newest readable checkpoint; returns its steps done (0: none).
        `UserInputError` if none of the checkpoints can be read."""

        def restore(prefix: str) -> int:
            self._checkpoint.restore(prefix).assert_existing_objects_matched()
            return int(self._step.numpy())

        return restore_newest(
            self._restore_dir, checkpoint_prefixes(self._restore_dir), restore, _UNREADABLE
        )

    def save(self, step: int) -> str:
        """Saves the state after `step` steps; returns the checkpoint path."""
        self._step.assign(step)
        return self._manager.save(checkpoint_number=step)


def checkpoint_prefixes(directory: str) -> list[str]:
    """The checkpoints' path prefixes in `directory`, newest first, from the files (not the
    `checkpoint` state file, which may miss one)."""
    return newest_first(directory, ".index")
