"""Tests of telemetry.metrics_csv: `model_dir/metrics.csv`, after a run and after a resume."""

import csv
import os

import keras
import pytest
from tiny_runs import Crash, CrashAtStep, tiny_config

from mpt_keras.errors import UserInputError
from mpt_keras.runs.model_dir import METRICS_CSV_FILE
from mpt_keras.runs.training import Runtime, run_training
from mpt_keras.telemetry.metrics_csv import MetricsCsv

COLUMNS = [
    "step",
    "accuracy",
    "bad_batches",
    "gradient_norm",
    "loss",
    "loss_scale",
    "skipped_steps",
    "val_accuracy",
    "val_loss",
]


def _rows(model_dir):
    with open(os.path.join(model_dir, METRICS_CSV_FILE), newline="") as file:
        reader = csv.DictReader(file)
        return reader.fieldnames, list(reader)


def test_a_run_writes_a_row_per_interval_with_the_loss_scale(tfds_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    metrics = run_training(tiny_config(tfds_dir), Runtime(model_dir, verbose=0))  # log_every=2
    columns, rows = _rows(model_dir)
    assert columns == COLUMNS
    # Rows at every log_every=2 steps, and at the validations (steps 3 and 6).
    assert [row["step"] for row in rows] == ["2", "3", "4", "6"]
    assert [(row["loss_scale"], row["skipped_steps"], row["bad_batches"]) for row in rows] == [
        ("1.0", "0.0", "0.0"),
        ("", "", ""),
        ("1.0", "0.0", "0.0"),
        ("1.0", "0.0", "0.0"),
    ]
    assert [row["val_loss"] != "" for row in rows] == [False, True, False, True]
    assert float(rows[-1]["val_loss"]) == pytest.approx(metrics["val_loss"], rel=1e-6)


def test_a_resumed_run_appends_without_duplicate_rows(tfds_dir, tmp_path):
    config = tiny_config(tfds_dir, steps=9)
    straight = str(tmp_path / "straight")
    run_training(config, Runtime(straight, verbose=0))
    resumed = str(tmp_path / "resumed")
    # Killed at step 5, after the row of step 4 and the checkpoint of step 3:
    # the rerun trains steps 4-9 again, and step 4 keeps one row.
    with pytest.raises(Crash):
        run_training(config, Runtime(resumed, verbose=0, callbacks=(CrashAtStep(5),)))
    assert [row["step"] for row in _rows(resumed)[1]] == ["2", "3", "4"]
    keras.backend.clear_session(free_memory=False)
    run_training(config, Runtime(resumed, verbose=0))

    columns, rows = _rows(resumed)
    assert columns == COLUMNS
    assert [row["step"] for row in rows] == ["2", "3", "4", "6", "8", "9"]
    assert rows == _rows(straight)[1]


def test_every_must_be_a_positive_integer():
    with pytest.raises(UserInputError) as raised:
        MetricsCsv("metrics.csv", 0)
    assert str(raised.value) == "every: received 0. Allowed: an integer >= 1"
