"""A multi-worker mpt-train run that loses a worker: the peer stops, a rerun resumes.

Two `mpt-train --strategy=multi_worker` processes on loopback, as in
test_distributed_launcher.py; worker 1 is killed once the chief has saved a
checkpoint.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import tensorflow as tf
from replicas import start_workers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.json")
INTERVAL = 4
# The survivor notices within PEER_TIMEOUT_SECONDS of the peer's last heartbeat,
# or at once when a connection to it breaks (measured: 2-12 s); the rest is
# slack for a loaded machine.
SURVIVOR_EXIT_SECONDS = 60
FIRST_CHECKPOINT_SECONDS = 240
RUN_SECONDS = 300
PEER_FAILED_STATUS = 75


def _start_workers(tfds_dir, tmp_path, steps):
    """Starts both workers of a run on tmp_path/run; returns their processes."""
    override = json.dumps(
        {
            "checkpoint_every": INTERVAL,
            "eval_every": INTERVAL,
            "data": {"data_dir": tfds_dir, "batch_size": 16, "eval_examples": 32},
            "model": {"options": {"hidden_units": [16]}},
        }
    )
    # A killed worker leaves its temporary write_dir behind: keep it in tmp_path.
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return start_workers(
        [
            sys.executable,
            "-m",
            "trainers.train",
            f"--config={CONFIG}",
            f"--model_dir={tmp_path / 'run'}",
            "--strategy=multi_worker",
            f"--steps={steps}",
            f"--config_override={override}",
        ],
        env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")),
        stdout=subprocess.DEVNULL,
    )


def _stop(processes):
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stderr.close()


def _last_checkpoint_step(model_dir):
    latest = tf.train.latest_checkpoint(str(model_dir / "checkpoints"))
    return int(latest.rsplit("-", 1)[1]) if latest else 0


@pytest.mark.slow
def test_killed_worker_stops_its_peer_in_bounded_time_and_a_rerun_resumes(tfds_dir, tmp_path):
    model_dir = tmp_path / "run"
    # Far more steps than run before the kill.
    processes = _start_workers(tfds_dir, tmp_path, steps=100_000)
    survivor, victim = processes
    try:
        deadline = time.monotonic() + FIRST_CHECKPOINT_SECONDS
        while not _last_checkpoint_step(model_dir):
            assert survivor.poll() is None, survivor.communicate()[1][-4000:]
            if time.monotonic() > deadline:  # Only a hang gets here.
                pytest.fail(f"no checkpoint saved in {FIRST_CHECKPOINT_SECONDS} s")
            time.sleep(0.2)
        victim.kill()  # SIGKILL: no chance to say goodbye.
        killed_at = time.monotonic()
        try:
            _, stderr = survivor.communicate(timeout=SURVIVOR_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker 0 still runs {SURVIVOR_EXIT_SECONDS} s after worker 1 died")
        survivor_seconds = time.monotonic() - killed_at
    finally:
        _stop(processes)

    assert survivor.returncode == PEER_FAILED_STATUS, stderr[-4000:]
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("mpt-train: error: ")]
    assert errors == stderr.splitlines()[-1:], stderr[-4000:]
    assert re.fullmatch(
        r"mpt-train: error: worker 0: worker 1 stopped answering, so TensorFlow aborted this "
        r"worker's collectives \(\w+Error: .+\)\. The checkpoints saved so far are complete: "
        rf"rerun all 2 workers with the same model_dir {re.escape(str(model_dir))} to resume "
        r"from the last one",
        errors[0],
    ), errors[0]
    print(f"worker 0 exited {survivor_seconds:.1f} s after worker 1 was killed")

    resumed_step = _last_checkpoint_step(model_dir)
    steps = resumed_step + INTERVAL
    processes = _start_workers(tfds_dir, tmp_path, steps=steps)
    try:
        outputs = [process.communicate(timeout=RUN_SECONDS)[1] for process in processes]
    finally:
        _stop(processes)
    for process, stderr in zip(processes, outputs):
        assert process.returncode == 0, stderr[-4000:]
        assert f" at step {resumed_step}.\n" in stderr
        assert f"Training steps {resumed_step + 1}..{steps} " in stderr
    assert json.loads((model_dir / "metrics.json").read_text())["step"] == steps
    # Every worker's final weights and loss scale are in its final metrics line.
    finals = [
        line.split("Final metrics: ", 1)[1]
        for stderr in outputs
        for line in stderr.splitlines()
        if "Final metrics: " in line
    ]
    assert len(finals) == 2 and finals[0] == finals[1]
