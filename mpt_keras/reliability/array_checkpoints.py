"""Checkpoints as NumPy files, for runs on any Keras backend (a JAX run has no tf.train).

`ArrayCheckpointer` keeps `Checkpointer`'s contract (backend/tensorflow/checkpoints.py): the
weights, the optimizer's state (the loss-scaling state in it), the steps done and named extra
variables, saved after a step and restored by a rerun on the same `model_dir`. A checkpoint is
`checkpoints/step-<N>.npz`, written under another name and renamed, so a kill leaves none torn;
one that cannot be read or does not match the model is skipped for the one before it.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping

import keras
import numpy as np

from mpt_keras.checkpoint_files import (
    CHECKPOINT_SUBDIR,
    PREFIX,
    newest_first,
    restore_newest,
)

_STEP = "step"


class ArrayCheckpointer:
    """Saves and restores the training state under `model_dir/checkpoints`.

    `model`, `optimizer`: built. `keep`: the newest checkpoints kept. `extra_variables`: more,
    by name (e.g. a rollback's learning rate scale).
    """

    def __init__(
        self,
        model_dir: str,
        model: keras.Model,
        optimizer: keras.Optimizer,
        keep: int,
        extra_variables: Mapping[str, keras.Variable] | None = None,
    ):
        # In (stable) creation order, as Checkpointer: paths carry process-dependent suffixes.
        self._variables = {
            **{f"model/{i}": variable for i, variable in enumerate(model.variables)},
            **{f"optimizer/{i}": variable for i, variable in enumerate(optimizer.variables)},
            **{f"extra/{name}": variable for name, variable in (extra_variables or {}).items()},
        }
        self._directory = os.path.join(model_dir, CHECKPOINT_SUBDIR)
        self._keep = keep

    def restore(self) -> int:
        """Restores the newest readable checkpoint; returns its steps done (0: none).
        `UserInputError` if none of the checkpoints can be read."""

        def restore(path: str) -> int:
            values, step = self._read(path)
            for key, variable in self._variables.items():
                variable.assign(values[key])
            return step

        return restore_newest(
            self._directory,
            checkpoint_files(self._directory),
            restore,
            (OSError, ValueError, KeyError, zipfile.BadZipFile),
        )

    def save(self, step: int) -> str:
        """Saves the state after `step` steps; returns the checkpoint path."""
        os.makedirs(self._directory, exist_ok=True)
        path = os.path.join(self._directory, f"{PREFIX}-{step}.npz")
        partial = os.path.join(self._directory, f".partial.{PREFIX}-{step}.npz")
        arrays = {key: keras.ops.convert_to_numpy(v.value) for key, v in self._variables.items()}
        with open(partial, "wb") as file:
            np.savez(file, **arrays, **{_STEP: np.int64(step)})
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
        for old in checkpoint_files(self._directory)[self._keep :]:
            os.remove(old)
        return path

    def _read(self, path: str) -> tuple[dict[str, np.ndarray], int]:
        """The checkpoint's arrays, checked against the variables; ValueError if they differ."""
        with np.load(path) as stored:
            values = {key: stored[key] for key in stored.files}
        expected = set(self._variables) | {_STEP}
        if set(values) != expected:
            raise ValueError(
                f"it holds {len(values) - 1} variables, the run has {len(self._variables)}"
            )
        for key, variable in self._variables.items():
            if tuple(values[key].shape) != tuple(variable.shape):
                raise ValueError(
                    f"{key} ({variable.path}) has shape {values[key].shape} there, "
                    f"{tuple(variable.shape)} here"
                )
        return values, int(values[_STEP])


def checkpoint_files(directory: str) -> list[str]:
    """The checkpoints in `directory`, newest first."""
    return [f"{stem}.npz" for stem in newest_first(directory, ".npz")]
