"""Tests for mpt_keras.checkpoint_files: the checkpoints a rerun finds, and the one it takes.

Both checkpointers' own tests (test_backend_tensorflow_checkpoints.py,
any_backend/test_array_checkpoints.py) resume through these on real files.
"""

import logging

import pytest

from mpt_keras.checkpoint_files import newest_first, restore_newest
from mpt_keras.errors import UserInputError


def test_newest_first_reads_the_files_of_one_suffix_by_step(tmp_path):
    for name in ("step-2.npz", "step-10.npz", "step-3.index", "step-x.npz", ".partial.step-11.npz"):
        (tmp_path / name).write_text("")
    assert newest_first(str(tmp_path), ".npz") == [
        str(tmp_path / "step-10"),
        str(tmp_path / "step-2"),
    ]
    assert newest_first(str(tmp_path), ".index") == [str(tmp_path / "step-3")]
    assert newest_first(str(tmp_path / "missing"), ".npz") == []


def test_the_newest_readable_one_is_restored_past_a_torn_one_with_a_warning(caplog):
    def restore(candidate):
        if candidate == "step-9":
            raise ValueError("torn\nmore")
        return int(candidate.split("-")[1])

    with caplog.at_level(logging.INFO):
        assert restore_newest("run/checkpoints", ["step-9", "step-6"], restore, (ValueError,)) == 6
    assert [record.getMessage() for record in caplog.records] == [
        "Checkpoint step-9 cannot be restored (torn): trying the one before it.",
        "Resumed from step-6 at step 6.",
    ]


def test_none_is_step_0_and_none_readable_is_one_line_naming_the_directory():
    def restore(candidate):
        raise KeyError() if candidate == "step-4" else OSError("no such file")

    assert restore_newest("run/checkpoints", [], restore, (KeyError, OSError)) == 0
    with pytest.raises(UserInputError) as raised:
        restore_newest("run/checkpoints", ["step-4", "step-2"], restore, (KeyError, OSError))
    # An error with no message is named by its type.
    assert str(raised.value) == (
        "run/checkpoints: none of its 2 checkpoints can be restored (the latest: KeyError); "
        "move the directory away to start over"
    )


def test_an_error_not_named_unreadable_is_raised():
    def restore(candidate):
        raise RuntimeError("a bug, not a torn file")

    with pytest.raises(RuntimeError, match="a bug"):
        restore_newest("run/checkpoints", ["step-1"], restore, (ValueError,))
