"""Files: atomic writes, output directories checked before use, and strict JSON reads.

A writer killed half-way leaves a temporary file beside the target, never a torn one
(`os.replace` is atomic on POSIX), so a file in `model_dir` is its old or new version. JSON
files hold non-finite numbers as strings (`json_safe`). `check_writable_dir` refuses, before
anything is written, an output directory that could not be.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from mpt_keras.checks import refusal
from mpt_keras.errors import UserInputError


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


def json_safe(value: Any) -> Any:
    """`value` with each non-finite float as the string `"inf"`, `"-inf"` or `"nan"` (which
    `float()` reads back): JSON has no Infinity or NaN (Python writes them, other readers
    refuse them), and a diverged run's loss must still be written and read back."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Writes `value` as indented, key-sorted, valid JSON (`json_safe`); see `write_text_atomic`."""
    text = json.dumps(json_safe(value), indent=2, sort_keys=True, allow_nan=False)
    write_text_atomic(path, text + "\n")


# Refuse a run that would fail on its first checkpoint; the digits models' run takes a few MiB.
MIN_FREE_BYTES = 64 * 2**20
_PROBE_PREFIX = ".write_probe."


def check_writable_dir(
    path: str | os.PathLike, what: str = "directory", min_free_bytes: int = MIN_FREE_BYTES
) -> None:
    """Creates directory `path` and checks that files can be written in it (every output
    directory's check). A probe file is written, fsynced and removed (`os.access` says yes to
    root on a read-only or full file system); then `min_free_bytes` must be free. Raises
    `UserInputError`: `<what>: received <path> (<why>). Allowed: ...`."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise _refusal(what, path, f"cannot be created: {error.strerror}", min_free_bytes) from None
    _probe(path, path, what, "not writable", min_free_bytes)


def check_creatable_dir(
    path: str | os.PathLike, what: str = "directory", min_free_bytes: int = MIN_FREE_BYTES
) -> None:
    """As `check_writable_dir`, creating nothing: probes `path` or the nearest existing parent.

    So a run can check its `model_dir` before its config is known good, and a bad config
    leaves no directory behind.
    """
    path = os.fspath(path)
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise _refusal(what, path, "cannot be created: Not a directory", min_free_bytes)
    failure = "not writable" if existing == os.path.abspath(path) else "cannot be created"
    _probe(existing, path, what, failure, min_free_bytes)


def _probe(directory: str, path: str, what: str, failure: str, min_free_bytes: int) -> None:
    try:
        # A name of its own: the workers of a multi-worker run probe together.
        descriptor, probe = tempfile.mkstemp(dir=directory, prefix=_PROBE_PREFIX)
        try:
            os.write(descriptor, b"probe\n")
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
            os.remove(probe)
    except OSError as error:
        raise _refusal(what, path, f"{failure}: {error.strerror}", min_free_bytes) from None
    status = os.statvfs(directory)
    free = status.f_bavail * status.f_frsize
    if free < min_free_bytes:
        raise _refusal(what, path, f"only {free // 2**20} MiB free", min_free_bytes)


def _refusal(what: str, path: str, why: str, min_free_bytes: int) -> UserInputError:
    allowed = "a directory that can be created and written"
    if min_free_bytes:
        allowed += f", with at least {min_free_bytes // 2**20} MiB free"
    return refusal(what, f"{path} ({why})", allowed)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a JSON file holding one object; `UserInputError` if it is missing, unreadable,
    not JSON (naming the line and column) or not an object."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        raise UserInputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserInputError(f"{path}: cannot be read ({error})") from None
    return parse_json_object(text, path)


def parse_json_object(text: str, source: str) -> dict[str, Any]:
    """Parses JSON text holding one object; errors name `source` and the position."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserInputError(
            f"{source}: malformed JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    except RecursionError:
        raise UserInputError(
            f"{source}: JSON arrays and objects nested too deeply for Python's "
            f"recursion limit ({sys.getrecursionlimit()})"
        ) from None
    except ValueError:
        # Python's limit on the digits of an integer it converts from text.
        raise UserInputError(
            f"{source}: a JSON integer is too long. Allowed: at most "
            f"{sys.get_int_max_str_digits()} digits"
        ) from None
    if not isinstance(value, dict):
        raise UserInputError(f"{source}: expected a JSON object, received {type(value).__name__}")
    return value
