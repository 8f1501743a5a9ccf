"""`--backend` (trainers/backend_flag.py): Keras' backend chosen before Keras is imported."""

import os
import sys

import pytest
from launchers import launch_console_script, launch_in_process

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
