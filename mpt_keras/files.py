"""Atomic writes: a file in `model_dir` is either its old or its new version.

A writer that is killed half-way leaves a temporary file beside the target,
never a torn target; `os.replace` is atomic on POSIX file systems.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    descriptor, temporary = tempfile.mkstemp(
        dir=directory, prefix="." + os.path.basename(path) + "."
    )
    try:
        # mkstemp creates the file private (0600); give it the usual umask mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Writes `value` as indented, key-sorted JSON; see `write_text_atomic`."""
    write_text_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n")
