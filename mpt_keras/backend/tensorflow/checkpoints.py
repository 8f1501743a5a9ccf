"""Checkpoints (weights, optimizer state, steps done: the data position too) a rerun on the
same `model_dir` resumes from; a torn one is skipped."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

import keras
import tensorflow as tf

from mpt_keras.errors import UserInputError

CHECKPOINT_SUBDIR = "checkpoints"
_PREFIX = "step"
# Raised reading a torn or foreign checkpoint.
_UNREADABLE = (tf.errors.OpError, ValueError, AssertionError, IndexError, KeyError)
_INDEX_FILE = re.compile(rf"^{_PREFIX}-(\d+)\.index$")
_LOGGER = logging.getLogger(__name__)


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
            checkpoint_name=_PREFIX,
        )

    def restore(self) -> int:
        """Restores the newest readable checkpoint; returns its steps done (0: none).
        `UserInputError` if none of the checkpoints can be read."""
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
        """Saves the state after `step` steps; returns the checkpoint path."""
        self._step.assign(step)
        return self._manager.save(checkpoint_number=step)


def checkpoint_prefixes(directory: str) -> list[str]:
    """The checkpoints' path prefixes in `directory`, newest first, from the files (not the
    `checkpoint` state file, which may miss one)."""
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
