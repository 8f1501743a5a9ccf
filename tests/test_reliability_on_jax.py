"""`kill -9` and resume on Keras' JAX backend: `mpt-train --backend=jax` in processes of its
own, killed at a random moment after its first checkpoint, ends bit-identical to a run never
killed (the NumPy checkpoints, `reliability/array_checkpoints.py`)."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from launchers import without_tensorflow

import mpt_keras  # noqa: F401  (registers the classes model.keras names)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A generous deadline for the first checkpoint: it only catches a hang.
HANG_SECONDS = 240


def _launch(model_dir):
    override = {
        "steps": 8,
        "checkpoint_every": 2,
        "eval_every": 2,
        "data": {"batch_size": 16, "eval_examples": 64},
        "model": {"options": {"hidden_units": [32], "dropout": 0.2}},
    }
    flags = [
        "--backend=jax",
        f"--config={os.path.join(REPO, 'configs', 'digits_mlp.json')}",
        f"--model_dir={model_dir}",
        "--precision=mixed_float16",
        "--deterministic",
        f"--config_override={json.dumps(override)}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "trainers.train", *flags],
        cwd=REPO,
        env=without_tensorflow(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process):
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]


def _weights(model_dir):
    return [np.asarray(w) for w in keras.saving.load_model(model_dir / "model.keras").weights]


@pytest.mark.slow
def test_a_jax_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_one(tmp_path):
    straight = _launch(tmp_path / "straight")
    killed = _launch(tmp_path / "killed")
    # Its log says when the first checkpoint is in place (an end of file: it died first, or
    # hung silently until the deadline killed it).
    deadline = threading.Timer(HANG_SECONDS, killed.kill)
    deadline.start()
    printed = []
    try:
        for line in killed.stderr:
            printed.append(line)
            if "saved" in line and "step-2.npz" in line:
                break
        else:
            pytest.fail(
                f"the run ended, or printed nothing for {HANG_SECONDS} s, before its first "
                "checkpoint: " + "".join(printed)[-3000:]
            )
    finally:
        deadline.cancel()
    time.sleep(random.uniform(0.0, 0.5))
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    _finish(straight)
    _finish(_launch(tmp_path / "killed"))
    metrics = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    assert metrics == json.loads((tmp_path / "straight" / "metrics.json").read_text())
    assert metrics["step"] == 8
    resumed, uninterrupted = _weights(tmp_path / "killed"), _weights(tmp_path / "straight")
    for ours, theirs in zip(resumed, uninterrupted, strict=True):
        np.testing.assert_array_equal(ours, theirs)
