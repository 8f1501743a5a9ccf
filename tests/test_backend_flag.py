"""`--backend` (trainers/backend_flag.py): Keras' backend chosen before Keras is imported."""

import os
import shutil
import subprocess
import sys

import pytest
from launchers import launch_console_script, launch_in_process, without_tensorflow

from trainers import backend_flag

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.json")


@pytest.mark.parametrize(
    "argv, backend",
    [
        (["--config=c.json", "--backend=jax"], "jax"),
        (["--backend", "jax", "--steps=2"], "jax"),
        (["--backend=jax", "--backend=tensorflow"], "tensorflow"),  # absl's: the last wins.
        (["--", "--backend=jax"], None),  # After `--`: not a flag.
        (["--backend=torch"], None),  # absl refuses it in one line.
        (["--steps=2"], None),
    ],
)
def test_select_sets_keras_backend_from_the_command_line_before_keras_loads(
    monkeypatch, argv, backend
):
    _unset_keras_backend(monkeypatch)
    monkeypatch.delitem(sys.modules, "keras")
    backend_flag.select(argv)
    assert os.environ.get("KERAS_BACKEND") == backend


def test_select_leaves_a_loaded_keras_alone(monkeypatch):
    _unset_keras_backend(monkeypatch)
    backend_flag.select(["--backend=jax"])
    assert "KERAS_BACKEND" not in os.environ


def test_a_backend_keras_no_longer_can_have_is_one_line():
    result = launch_in_process("mpt-train", f"--config={CONFIG}", "--model_dir=x", "--backend=jax")
    assert (result.status, result.stderr.strip()) == (
        2,
        "mpt-train: error: --backend=jax: Keras is already loaded with backend tensorflow in "
        "this process. Allowed: --backend=tensorflow, or a new process",
    )


def test_mpt_bench_takes_either_backend_and_refuses_one_keras_no_longer_can_have():
    result = launch_in_process("mpt-bench", "--backend=jax")
    assert (result.status, result.stderr.strip()) == (
        2,
        "mpt-bench: error: --backend=jax: Keras is already loaded with backend tensorflow in "
        "this process. Allowed: --backend=tensorflow, or a new process",
    )


def test_the_console_script_runs_on_the_backend_it_is_given(tmp_path):
    """A process of its own: the flag acts before Keras is first imported."""
    result = launch_console_script(
        "mpt-train",
        f"--config={CONFIG}",
        f"--model_dir={tmp_path}",
        "--backend=jax",
        '--config_override={"steps": 1, "checkpoint_every": 1, "eval_every": 1}',
    )
    assert result.status == 0, result.stderr
    assert "Training steps 1..1 in intervals of 1 (float32, Keras backend jax)." in (result.stderr)
    assert os.listdir(tmp_path / "checkpoints") == ["step-1.npz"]


def _unset_keras_backend(monkeypatch):
    """Unset for the test, and as it was after it, even where `select` sets it (a variable
    left set would give the worker's later processes the JAX backend)."""
    monkeypatch.setenv("KERAS_BACKEND", "")
    monkeypatch.delenv("KERAS_BACKEND")


@pytest.mark.parametrize("program", ["mpt-train", "mpt-bench"])
def test_a_backend_keras_cannot_load_is_one_line(tmp_path, program):
    """As on a machine without TensorFlow (the lent GPUs) when no backend is chosen: Keras'
    default is TensorFlow. A process of its own, whose Keras has not loaded yet."""
    env = without_tensorflow()
    env.pop("KERAS_BACKEND", None)
    env["KERAS_HOME"] = str(tmp_path)  # No keras.json choosing another backend.
    script = shutil.which(program) or os.path.join(os.path.dirname(sys.executable), program)
    argv = (
        [f"--config={CONFIG}", f"--model_dir={tmp_path / 'run'}"] if program == "mpt-train" else []
    )
    done = subprocess.run(
        [script, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stderr.strip()) == (
        2,
        f"{program}: error: Keras cannot load its backend (its default or "
        "~/.keras/keras.json's) here: no module named 'tensorflow'. Allowed: --backend=jax or "
        "--backend=tensorflow, whichever is installed",
    )
    assert not (tmp_path / "run").exists()
