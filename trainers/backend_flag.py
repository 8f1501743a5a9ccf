"""`--backend`: the Keras backend a launcher runs on, chosen before Keras is imported.

Keras reads its backend once, when it is first imported (`KERAS_BACKEND`, else
`~/.keras/keras.json`), so `trainers/__init__.py` calls `select` before any launcher's imports;
the flag itself is then parsed by absl like the others (a launcher serving TensorFlow only lists
only it), and `check` refuses a backend this process cannot have any more.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import flags

from mpt_keras.backend.names import BACKENDS
from mpt_keras.errors import UserInputError


def select(argv: Sequence[str] | None = None) -> None:
    """Sets `KERAS_BACKEND` from `--backend` in `argv` (the command line) while Keras is not
    imported yet; absl refuses an unknown value, `check` a late one."""
    value = _flag_value(sys.argv[1:] if argv is None else argv)
    if value in BACKENDS and "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = value


def define(module_name: str, served: Sequence[str] = BACKENDS) -> flags.FlagHolder:
    """The launcher's `--backend` flag, listed under `module_name` in its `--help`."""
    return flags.DEFINE_enum(
        "backend",
        None,
        list(served),
        "Keras backend to run on; default: Keras' configured one (KERAS_BACKEND, else "
        "~/.keras/keras.json).",
        module_name=module_name,
    )


def check(program: str, requested: str | None, served: Sequence[str] = BACKENDS) -> None:
    """Refuses, in one line, a run on a backend other than `requested`, or not `served`."""
    import keras

    loaded = keras.backend.backend()
    if requested is not None and requested != loaded:
        raise UserInputError(
            f"--backend={requested}: Keras is already loaded with backend {loaded} in this "
            f"process. Allowed: --backend={loaded}, or a new process"
        )
    if loaded not in served:
        raise UserInputError(
            f"{program} runs on Keras backend {' or '.join(served)}, and Keras has {loaded} "
            "(KERAS_BACKEND or ~/.keras/keras.json); docs/backends.md says why. "
            f"Allowed: --backend={served[0]}"
        )


def _flag_value(argv: Sequence[str]) -> str | None:
    """The last `--backend=X` or `--backend X` before a `--`, as absl reads it."""
    value = None
    for index, argument in enumerate(argv):
        if argument == "--":
            break
        if argument.startswith("--backend="):
            value = argument.partition("=")[2]
        elif argument == "--backend" and index + 1 < len(argv):
            value = argv[index + 1]
    return value
