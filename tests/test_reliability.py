"""What a run guarantees when things go wrong: NaN data, divergence, kills, determinism."""

import dataclasses
import glob
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from launchers import launch_in_process
from tensorflow.python.framework import config as tf_config
from tiny_runs import small_model

from mpt_keras import data
from mpt_keras.config import TrainConfig, resolve_config
from mpt_keras.errors import RunStoppedError, UserInputError
from mpt_keras.runs.training import Runtime, run_training

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 16


def _config(tfds_dir, **changes):
    values = {
        "precision": "float32",
        "steps": 6,
        "checkpoint_every": 2,
        "eval_every": 2,
        "log_every": 1,
        "data": {
            "name": "mpt_digits",
            "data_dir": tfds_dir,
            "batch_size": BATCH,
            "eval_examples": 64,
        },
        "model": {"name": "mlp", "options": {"hidden_units": [16]}},
        "optimizer": {"name": "adam", "learning_rate": 0.01},
    }
    return TrainConfig.from_dict(values).merged(changes)


def _weights(model_dir):
    model = keras.saving.load_model(os.path.join(model_dir, "model.keras"))
    return [np.asarray(w) for w in model.weights]


# --- NaN in the data ----------------------------------------------------------


def _poison(monkeypatch, tfds_dir, bad_steps, seed=0):
    """Puts a NaN into one example of each 1-based train step in `bad_steps` of what a run
    loads (the embedded digits, read from memory: TFDS' examples)."""
    clean = data.classification_arrays("mpt_digits", "train", tfds_dir)
    order = np.arange(len(clean.labels), dtype=np.float32)[:, None]
    batches = data.train_batches(order, clean.labels, BATCH, seed=seed).take(max(bad_steps))
    indices = [batch[0][:, 0].numpy().astype(int) for batch in batches]
    features = clean.features.copy()
    for position, step in enumerate(bad_steps):
        features[indices[step - 1][position % BATCH]].flat[position] = np.nan
    original = data.load_run_data

    def poisoned(*args, **kwargs):
        loaded = original(*args, **kwargs)
        np.testing.assert_array_equal(loaded.train[0], clean.features)
        return dataclasses.replace(loaded, train=(features, loaded.train[1]))

    monkeypatch.setattr(data, "load_run_data", poisoned)


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_nan_batches_are_skipped_counted_and_reported_with_their_step(
    tfds_dir, tmp_path, monkeypatch, caplog, precision
):
    _poison(monkeypatch, tfds_dir, bad_steps=[2, 5])
    caplog.set_level(logging.WARNING, logger="mpt_keras.telemetry.monitor")
    with caplog.at_level(logging.WARNING, logger="mpt_keras.reliability.guards"):
        metrics = run_training(
            _config(tfds_dir, precision=precision), Runtime(str(tmp_path), verbose=0)
        )
    assert (metrics["step"], metrics["bad_batches"], metrics["skipped_steps"]) == (6, 2, 2)
    # The monitor diagnoses the first bad batch on the batch of its step (one a
    # 100 steps): its NaN is in the model's input.
    [diagnosis] = [
        r.getMessage() for r in caplog.records if r.name == "mpt_keras.telemetry.monitor"
    ]
    assert diagnosis.startswith("step 2: first non-finite output: ")
    assert diagnosis.endswith(", its inputs already non-finite")
    # Not overflows: the float16 scale did not back off.
    assert metrics["loss_scale"] == (32768.0 if precision == "mixed_float16" else 1.0)
    assert all(np.isfinite(w).all() for w in _weights(str(tmp_path)))
    reported = " ".join(r.getMessage() for r in caplog.records)
    assert "at step(s) 2 " in reported and "at step(s) 5 " in reported


def test_more_bad_batches_than_allowed_stop_the_run_with_one_line(tfds_dir, tmp_path, monkeypatch):
    _poison(monkeypatch, tfds_dir, bad_steps=[1, 3])
    config = _config(tfds_dir, data={"max_bad_batches": 1})
    with pytest.raises(RunStoppedError) as stopped:
        run_training(config, Runtime(str(tmp_path), verbose=0))
    message = str(stopped.value)
    assert message.startswith("2 train batches held NaN or Inf values (the latest at step 3)")
    assert "data.max_bad_batches=1" in message and "\n" not in message
    assert not os.path.exists(tmp_path / "model.keras")


# --- Divergence -----------------------------------------------------------------

# SGD at learning rate 30 blows the MLP's loss up within a few steps.
_EXPLODING = {"optimizer": {"name": "sgd", "learning_rate": 30.0}}


def _checkpoint_value(model_dir, name):
    latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
    return tf.train.load_checkpoint(latest).get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")


def test_divergence_stops_without_saving_the_diverged_state(tfds_dir, tmp_path):
    config = _config(
        tfds_dir, **_EXPLODING, divergence={"patience": 2, "max_loss": 5.0, "action": "stop"}
    )
    with pytest.raises(RunStoppedError, match=r"^training diverged at step \d+: the loss") as info:
        run_training(config, Runtime(str(tmp_path), verbose=0))
    assert "divergence.action=stop" in str(info.value)
    assert not os.path.exists(tmp_path / "model.keras")
    assert not os.path.exists(tmp_path / "metrics.json")
    # Only states saved while the loss was healthy: the one before training at least.
    diverged_at = int(re.match(r"training diverged at step (\d+)", str(info.value)).group(1))
    saved = sorted(
        int(os.path.basename(p)[5:-6])
        for p in glob.glob(str(tmp_path / "checkpoints" / "step-*.index"))
    )
    assert saved[0] == 0 and saved[-1] < diverged_at


def test_rollback_lowers_the_learning_rate_until_training_is_healthy(tfds_dir, tmp_path, caplog):
    config = _config(
        tfds_dir,
        **_EXPLODING,
        divergence={"patience": 2, "max_loss": 5.0, "lr_factor": 0.001, "max_rollbacks": 2},
    )
    with caplog.at_level(logging.WARNING, logger="mpt_keras.runs.fit_loop"):
        metrics = run_training(config, Runtime(str(tmp_path), verbose=0))
    assert metrics["step"] == 6
    assert metrics["val_loss"] < 5.0  # Healthy (it was 15.7 when it diverged).
    assert any("rolled back to step" in r.getMessage() for r in caplog.records)
    # The lowered rate is saved with the run: a resumed run keeps it.
    assert _checkpoint_value(str(tmp_path), "learning_rate_scale") == pytest.approx(0.001)


def test_promotion_that_does_not_help_stops_after_max_rollbacks(tfds_dir, tmp_path):
    config = _config(
        tfds_dir,
        **_EXPLODING,
        precision="mixed_bfloat16",
        divergence={"patience": 2, "max_loss": 5.0, "action": "promote", "max_rollbacks": 1},
    )
    with pytest.raises(RunStoppedError, match="after 1 rollbacks"):
        run_training(config, Runtime(str(tmp_path), verbose=0))
    promoted = json.loads((tmp_path / "promoted_manifest.json").read_text())
    assert {rule["policy"] for rule in promoted["rules"]} == {"float32"}


# --- Determinism ------------------------------------------------------------------


class _DeterminismProbe(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.enabled = tf_config.is_op_determinism_enabled()


@pytest.mark.parametrize(
    "name, jit_compile, xla",
    [
        ("digits_cnn.json", "auto", False),  # XLA has no deterministic MaxPool gradient.
        ("digits_cnn.json", "true", None),  # Refused, below.
        ("digits_mlp.json", "auto", None),  # Off on CPUs, on on GPUs.
        ("digits_mlp.json", "true", True),
        # `auto` turns XLA on for attention models on every device: `true` would be this run.
        ("python_source_transformer.json", "auto", True),
    ],
)
def test_two_deterministic_runs_of_each_bundled_config_are_identical(
    tfds_dir, tmp_path, name, jit_compile, xla
):
    """With XLA where it can be deterministic; refused in one line where it cannot.

    Op determinism is on during the run, and off again after it.
    """
    override = {
        "steps": 4,
        "checkpoint_every": 2,
        "eval_every": 2,
        "saved_model": False,  # Weights are the point.
        **small_model(name),  # The determinism of its layers (dropout too), not their size.
    }
    override["data"] = {
        **override.get("data", {}),
        "data_dir": tfds_dir,
        "batch_size": 8,
        "eval_examples": 16,
    }
    config = resolve_config(
        os.path.join(REPO, "configs", name),
        json.dumps(override),
        deterministic=True,
        jit_compile=jit_compile,
    )
    if name == "digits_cnn.json" and jit_compile == "true":
        with pytest.raises(UserInputError) as raised:
            run_training(config, Runtime(str(tmp_path / "a"), verbose=0))
        assert str(raised.value) == (
            "jit_compile=true with deterministic: XLA has no deterministic MaxPool gradient "
            "(layer 'pool_0', MaxPooling2D). Use jit_compile=false or auto (XLA off for this "
            "model), or train without deterministic"
        )
        assert not (tmp_path / "a").exists()
        return
    probe = _DeterminismProbe()
    run_training(config, Runtime(str(tmp_path / "a"), verbose=0, callbacks=(probe,)))
    assert probe.enabled
    assert not tf_config.is_op_determinism_enabled()
    keras.backend.clear_session(free_memory=False)
    run_training(config, Runtime(str(tmp_path / "b"), verbose=0))
    for a, b in zip(_weights(str(tmp_path / "a")), _weights(str(tmp_path / "b")), strict=True):
        np.testing.assert_array_equal(a, b)
    report = json.loads((tmp_path / "a" / "precision_report.json").read_text())
    if xla is not None:
        assert report["jit_compile"] is xla, report["jit_compile_reason"]


# --- kill -9 and resume -----------------------------------------------------------


# Runs mpt-train; with MPT_TEST_PAUSE_MARKER set, the first checkpoint it saves
# pauses after its shards are written and before it is recorded (the marker
# file says so), for a kill in the middle of a checkpoint write.
_TRAIN_CHILD = """
import os, pathlib, sys, time
from tensorflow.python.checkpoint import checkpoint_management
marker = os.environ.get("MPT_TEST_PAUSE_MARKER")
if marker:
    record = checkpoint_management.update_checkpoint_state_internal
    def paused(*args, **kwargs):
        pathlib.Path(marker).touch()
        time.sleep(60)
        return record(*args, **kwargs)
    checkpoint_management.update_checkpoint_state_internal = paused
sys.argv[0] = "mpt-train"
from trainers import train
train.run()
"""
# The kills come within the first ~20 steps; the rest keeps the run alive past them.
KILL_RUN_STEPS = 60


def _train_flags(model_dir, tfds_dir):
    override = {
        "checkpoint_every": 3,
        "eval_every": 3,
        "data": {"data_dir": tfds_dir, "batch_size": BATCH, "eval_examples": 64},
        "model": {"options": {"hidden_units": [32], "dropout": 0.2}},
    }
    return [
        f"--config={os.path.join(REPO, 'configs', 'digits_mlp.json')}",
        f"--model_dir={model_dir}",
        "--precision=mixed_float16",
        f"--steps={KILL_RUN_STEPS}",
        "--deterministic",
        f"--config_override={json.dumps(override)}",
    ]


def _launch(model_dir, tfds_dir, pause_marker=None):
    env = dict(os.environ)
    if pause_marker is not None:
        env["MPT_TEST_PAUSE_MARKER"] = str(pause_marker)
    return subprocess.Popen(
        [sys.executable, "-c", _TRAIN_CHILD, *_train_flags(model_dir, tfds_dir)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process):
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    return stderr


def _wait_for(condition, process, what):
    """Polls `condition` while `process` runs; a generous deadline only catches a hang."""
    deadline = time.monotonic() + 240
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the run ended before {what}: {process.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} in 240 s")
        time.sleep(0.02)


def _kill(process):
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.slow
def test_killed_three_times_then_resumed_matches_an_uninterrupted_run(tfds_dir, tmp_path):
    """kill -9 mid-interval, mid-checkpoint-write and at a random point after a
    checkpoint; the resumed run ends bit-identical to an uninterrupted one.

    The uninterrupted run needs no process of its own: it runs the launcher here.
    """
    straight = tmp_path / "straight"
    uninterrupted = launch_in_process("mpt-train", *_train_flags(straight, tfds_dir))
    assert uninterrupted.status == 0, uninterrupted.stderr

    killed = tmp_path / "killed"
    checkpoints = killed / "checkpoints"
    rng = random.Random(20261124)

    def saved() -> int:
        """The step of the latest checkpoint whose shards are written (0: none)."""
        steps = [
            int(re.search(r"step-(\d+)", p).group(1))
            for p in glob.glob(str(checkpoints / "*.index"))
        ]
        return max(steps, default=0)

    # 1: at a random moment after the first checkpoint.
    process = _launch(killed, tfds_dir)
    _wait_for(lambda: saved() > 0, process, "first checkpoint")
    time.sleep(rng.uniform(0.0, 0.3))
    _kill(process)
    # 2: in the middle of writing a checkpoint (shards written, not recorded).
    marker = tmp_path / "writing"
    process = _launch(killed, tfds_dir, pause_marker=marker)
    _wait_for(marker.exists, process, "checkpoint write")
    _kill(process)
    # 3: at a random moment after one more checkpoint.
    before = saved()
    process = _launch(killed, tfds_dir)
    _wait_for(lambda: saved() > before, process, "new checkpoint")
    time.sleep(rng.uniform(0.0, 0.3))
    assert process.poll() is None, "the run ended before the third kill"
    _kill(process)

    _finish(_launch(killed, tfds_dir))
    metrics = json.loads((killed / "metrics.json").read_text())
    assert metrics == json.loads((straight / "metrics.json").read_text())
    assert metrics["step"] == KILL_RUN_STEPS
    for a, b in zip(_weights(straight), _weights(killed), strict=True):
        np.testing.assert_array_equal(a, b)
