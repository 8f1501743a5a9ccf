"""mpt-train under tf.distribute, run as users run it: mirrored, multi-worker, TPU."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from replicas import communicate_all, start_workers

import mpt_keras  # noqa: F401  (registers the classes model.keras refers to)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.json")


def _override(tfds_dir):
    return json.dumps(
        {
            "checkpoint_every": 2,
            "eval_every": 2,
            "data": {"data_dir": tfds_dir, "batch_size": 16, "eval_examples": 32},
        }
    )


def _command(*flags):
    return [sys.executable, "-m", "trainers.train", f"--config={CONFIG}", *flags]


@pytest.mark.parametrize("precision", ["mixed_float16", "mixed_bfloat16"])
def test_mirrored_on_two_virtual_cpus_with_xla(tfds_dir, tmp_path, precision):
    model_dir = tmp_path / "run"
    result = subprocess.run(
        _command(
            f"--model_dir={model_dir}",
            f"--precision={precision}",
            "--strategy=mirrored",
            "--virtual_cpus=2",
            "--jit_compile=true",
            "--steps=4",
            f"--config_override={_override(tfds_dir)}",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
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
    result = subprocess.run(
        _command(f"--model_dir={tmp_path / 'run'}", "--strategy=tpu", "--tpu=grpc://127.0.0.1:1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mpt-train: error: strategy 'tpu': ")
