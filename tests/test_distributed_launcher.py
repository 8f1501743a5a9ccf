"""mpt-train under tf.distribute, run as users run it: mirrored, multi-worker, TPU.

The mirrored runs split the CPU (`--virtual_cpus`), which only a process whose
TensorFlow has not initialized its devices can do: both precisions run the
launcher's entry point in one child process (tests/replicas.py), the first
splitting the CPU as a user's run does, the second on the devices already split.
Multi-worker runs are processes, one per worker; the TPU case fails before any
device work, in this process (tests/launchers.py).
"""

import json
import os
import sys

import keras
import numpy as np
import pytest
from launchers import launch_in_process
from replicas import communicate_all, run_child, start_workers

import mpt_keras  # noqa: F401  (registers the classes model.keras refers to)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.json")
MIRRORED_PRECISIONS = ("mixed_float16", "mixed_bfloat16")


def _override(tfds_dir):
    return json.dumps(
        {
            "checkpoint_every": 2,
            "eval_every": 2,
            "data": {"data_dir": tfds_dir, "batch_size": 16, "eval_examples": 32},
            "model": {"options": {"hidden_units": [16]}},
        }
    )


def _command(*flags):
    return [sys.executable, "-m", "trainers.train", f"--config={CONFIG}", *flags]


def _train_mirrored(tfds_dir, runs_dir):
    """In a child: mpt-train on two virtual CPUs with XLA, once per precision."""
    outcomes = {}
    for precision in MIRRORED_PRECISIONS:
        result = launch_in_process(
            "mpt-train",
            f"--config={CONFIG}",
            f"--model_dir={os.path.join(runs_dir, precision)}",
            f"--precision={precision}",
            "--strategy=mirrored",
            "--virtual_cpus=2",
            "--jit_compile=true",
            "--steps=4",
            f"--config_override={_override(tfds_dir)}",
        )
        outcomes[precision] = [result.status, result.stderr]
    return outcomes


@pytest.fixture(scope="module")
def mirrored_runs(tfds_dir, tmp_path_factory):
    """The runs' directory, and each precision's exit status and stderr."""
    runs_dir = tmp_path_factory.mktemp("mirrored")
    # No split before: the first run's --virtual_cpus=2 splits the CPU.
    outcomes = run_child(
        "test_distributed_launcher", "_train_mirrored", tfds_dir, str(runs_dir), virtual_cpus=0
    )
    return runs_dir, outcomes


@pytest.mark.parametrize("precision", MIRRORED_PRECISIONS)
def test_mirrored_on_two_virtual_cpus_with_xla(mirrored_runs, precision):
    runs_dir, outcomes = mirrored_runs
    status, stderr = outcomes[precision]
    assert status == 0, stderr
    model_dir = runs_dir / precision
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert (metrics["step"], metrics["precision"]) == (4, precision)
    report = json.loads((model_dir / "precision_report.json").read_text())
    assert report["jit_compile"] is True


def test_two_workers_on_loopback_finish_with_identical_weights_and_loss_scale(tfds_dir, tmp_path):
    processes = start_workers(
        _command(
            f"--model_dir={tmp_path / 'run'}",
            "--precision=mixed_float16",
            "--strategy=multi_worker",
            "--steps=4",
            f"--config_override={_override(tfds_dir)}",
        ),
        env=os.environ,
    )
    outputs = communicate_all(processes)
    for returncode, _, stderr in outputs:
        assert returncode == 0, stderr
    model_dir = tmp_path / "run"
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["step"] == 4
    # Only the chief (worker 0) writes into model_dir; every worker's final
    # weights and loss scale are in its log line of the final metrics.
    finals = [
        line.split("Final metrics: ", 1)[1]
        for _, _, stderr in outputs
        for line in stderr.splitlines()
        if "Final metrics: " in line
    ]
    assert len(finals) == 2 and finals[0] == finals[1]
    model = keras.saving.load_model(str(model_dir / "model.keras"))
    assert all(np.isfinite(np.asarray(w)).all() for w in model.weights)


def test_tpu_without_a_tpu_is_one_clear_line(tmp_path):
    result = launch_in_process(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={tmp_path / 'run'}",
        "--strategy=tpu",
        "--tpu=grpc://127.0.0.1:1",
    )
    assert result.status == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mpt-train: error: strategy 'tpu': ")
