"""Tests of mpt_keras.files: the check that a directory can be written before a run."""

import errno
import json
import os

import numpy as np
import pytest

from mpt_keras import files
from mpt_keras.errors import UserInputError


def _refused(path, why):
    return (
        f"model_dir: received {path} ({why}). "
        "Allowed: a directory that can be created and written, with at least 64 MiB free"
    )


def test_creates_the_directory_and_leaves_nothing_in_it(tmp_path):
    directory = tmp_path / "a" / "run"
    files.check_writable_dir(directory, what="model_dir")
    assert directory.is_dir()
    assert os.listdir(directory) == []


def test_a_directory_under_a_regular_file_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "run"
    with pytest.raises(UserInputError) as raised:
        files.check_writable_dir(directory, what="model_dir")
    assert str(raised.value) == _refused(directory, "cannot be created: Not a directory")


@pytest.mark.parametrize(
    "failing, code, reason",
    [
        ("fsync", errno.ENOSPC, "No space left on device"),
        ("write", errno.ENOSPC, "No space left on device"),
        ("open", errno.EROFS, "Read-only file system"),
    ],
)
def test_a_failing_probe_write_is_not_writable(tmp_path, monkeypatch, failing, code, reason):
    # As root, os.access says yes to everything: only writing tells.
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(UserInputError) as raised:
        files.check_writable_dir(tmp_path, what="model_dir")
    monkeypatch.undo()
    assert str(raised.value) == _refused(tmp_path, f"not writable: {reason}")
    assert os.listdir(tmp_path) == []  # The probe is removed.


def test_too_little_free_space(tmp_path, monkeypatch):
    class Full:
        f_frsize = 4096
        f_bavail = 12 * 2**20 // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full)
    with pytest.raises(UserInputError) as raised:
        files.check_writable_dir(tmp_path, what="model_dir")
    assert str(raised.value) == _refused(tmp_path, "only 12 MiB free")
    Full.f_bavail = files.MIN_FREE_BYTES // 4096
    files.check_writable_dir(tmp_path, what="model_dir")  # Exactly the minimum is enough.


def test_checking_a_directory_to_be_creates_nothing(tmp_path):
    directory = tmp_path / "a" / "run"
    files.check_creatable_dir(directory, what="model_dir")
    assert os.listdir(tmp_path) == []


def test_a_directory_to_be_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "a" / "run"
    with pytest.raises(UserInputError) as raised:
        files.check_creatable_dir(directory, what="model_dir")
    assert str(raised.value) == _refused(directory, "cannot be created: Not a directory")


def test_a_directory_to_be_in_a_read_only_place_is_refused(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(files.tempfile, "mkstemp", read_only)
    with pytest.raises(UserInputError) as raised:
        files.check_creatable_dir(tmp_path / "run", what="model_dir")
    assert str(raised.value) == _refused(
        tmp_path / "run", "cannot be created: Read-only file system"
    )


def test_json_files_hold_non_finite_numbers_as_strings_and_stay_valid_json(tmp_path):
    path = tmp_path / "metrics.json"
    files.write_json_atomic(
        path, {"loss": float("nan"), "values": [1.5, float("inf"), -float("inf")]}
    )
    written = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(name))
    assert written == {"loss": "nan", "values": [1.5, "inf", "-inf"]}
    assert [float(value) for value in written["values"]] == [1.5, float("inf"), -float("inf")]


def test_json_safe_takes_numpy_float64_in_nested_values():
    assert files.json_safe({"a": [np.float64("nan"), 1.0], "b": (np.float64("-inf"),)}) == {
        "a": ["nan", 1.0],
        "b": ["-inf"],
    }
