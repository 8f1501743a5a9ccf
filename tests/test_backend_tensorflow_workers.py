"""Tests for mpt_keras.backend.tensorflow.workers: which worker writes files.

A real two-worker run, where only the chief writes into `model_dir`, is in
tests/test_backend_tensorflow_distribute.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tensorflow as tf

from mpt_keras.backend.tensorflow import workers


@pytest.mark.parametrize(
    ("task_type", "task_id", "jobs", "expected"),
    [
        (None, None, [], True),
        ("worker", 0, ["worker"], True),
        ("worker", 1, ["worker"], False),
        ("chief", 0, ["chief", "worker"], True),
        ("worker", 0, ["chief", "worker"], False),
        ("evaluator", 0, ["worker", "evaluator"], False),
    ],
    ids=["local", "worker_0", "worker_1", "chief", "worker_0_with_chief", "evaluator"],
)
def test_chief_rule_of_the_multi_worker_tutorial(task_type, task_id, jobs, expected):
    assert workers._is_chief_task(task_type, task_id, jobs) is expected


@pytest.mark.parametrize(
    "make",
    [
        tf.distribute.get_strategy,
        lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
        lambda: tf.distribute.MirroredStrategy(["/cpu:0"]),
    ],
    ids=["default", "one_device", "mirrored"],
)
def test_single_process_strategies_are_chief(make, tmp_path):
    strategy = make()
    assert workers.is_chief(strategy)
    with workers.worker_write_dir(str(tmp_path), strategy) as write_dir:
        assert write_dir == str(tmp_path)
    assert tmp_path.is_dir()


def test_non_chief_writes_into_a_temporary_dir_removed_afterwards(monkeypatch, tmp_path):
    monkeypatch.setattr(workers, "is_chief", lambda strategy: False)
    with pytest.raises(RuntimeError, match="crash"):
        with workers.worker_write_dir(str(tmp_path), tf.distribute.get_strategy()) as write_dir:
            assert write_dir != str(tmp_path) and os.path.isdir(write_dir)
            Path(write_dir, "model.keras").write_text("saved")
            raise RuntimeError("crash")
    assert not os.path.exists(write_dir)
    assert list(tmp_path.iterdir()) == []
