"""Tests for mpt_keras.backend.tensorflow.distribute: strategies by name, and a two-worker run.

Argument checks run in the pytest process. Splitting the CPU must happen before
TensorFlow initializes its runtime, so `make_strategy("mirrored",
virtual_cpus=2)` runs first thing in a child process (`replicas.run_child`), which prints
JSON the tests assert on. A real two-worker MultiWorkerMirroredStrategy runs as
two more child processes talking over loopback (`_WORKER`), each training the
same model with XLA per replica on the toolkit's train stream.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from replicas import communicate_all, run_child, start_workers

from mpt_keras import data, models
from mpt_keras.backend.tensorflow import distribute, tpu_connection
from mpt_keras.backend.tensorflow.workers import is_chief, worker_write_dir
from mpt_keras.errors import UserInputError
from mpt_keras.execution import xla
from mpt_keras.scaling.optimizer import LossScaleOptimizer

_TESTS_DIR = Path(__file__).resolve().parent
_WORKER = """
import json, sys, test_backend_tensorflow_distribute as test_module
print(json.dumps(test_module._worker_results(sys.argv[1])))
"""
_TF_CONFIG_SHAPE = (
    'Allowed: JSON like {"cluster": {"worker": ["host0:port", "host1:port"]}, '
    '"task": {"type": "worker", "index": 0}}'
)
_TPU_ALLOWED = "Allowed: a TPU address via --tpu, or another --strategy"
GLOBAL_BATCH = 8
STEPS = 3


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- Argument checks (in the pytest process) ------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(name="ring"),
            "strategy: received 'ring'. Allowed: auto, one_device, mirrored, multi_worker, tpu",
        ),
        (
            dict(name="auto", virtual_cpus=2),
            "virtual_cpus=2 needs strategy 'mirrored'; received strategy 'auto'. "
            "Allowed: virtual_cpus=0, or strategy 'mirrored'",
        ),
        (
            dict(name="multi_worker", virtual_cpus=2),
            "virtual_cpus=2 needs strategy 'mirrored'; received strategy 'multi_worker'. "
            "Allowed: virtual_cpus=0, or strategy 'mirrored'",
        ),
        (
            dict(name="mirrored", virtual_cpus=-1),
            "virtual_cpus: received -1. Allowed: an integer >= 0",
        ),
        (
            dict(name="mirrored", tpu="local"),
            "tpu='local' needs strategy 'tpu' or 'auto'; received strategy 'mirrored'. "
            "Allowed: no tpu, or strategy 'tpu' or 'auto'",
        ),
    ],
)
def test_make_strategy_rejects_bad_arguments(kwargs, message):
    with pytest.raises(UserInputError) as info:
        distribute.make_strategy(**kwargs)
    assert str(info.value) == message


def test_virtual_cpus_after_the_runtime_started_is_refused():
    tf.constant(0.0)  # Initializes the runtime, if no other test did.
    existing = len(tf.config.list_logical_devices("CPU"))
    with pytest.raises(UserInputError) as info:
        distribute.make_strategy("mirrored", virtual_cpus=existing + 5)
    assert str(info.value) == (
        f"virtual_cpus={existing + 5}: TensorFlow's runtime is already initialized with "
        f"{existing} CPU device(s), so the CPU can no longer be split; create the strategy "
        f"before any other TensorFlow op. Allowed now: virtual_cpus={existing}"
    )


@pytest.mark.parametrize(
    ("tf_config", "problem"),
    [
        (None, "is not set"),
        (
            "{cluster",
            "is not JSON (Expecting property name enclosed in double quotes at character 1)",
        ),
        ("[]", "has no 'cluster' with a non-empty 'worker' or 'chief' list"),
        (
            '{"cluster": {"worker": []}}',
            "has no 'cluster' with a non-empty 'worker' or 'chief' list",
        ),
        ('{"cluster": {"worker": ["a:1"]}}', "has no 'task' object"),
        (
            '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}',
            'task {"type": "worker", "index": 2} is not in its cluster',
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
            'task {"type": "chief", "index": 0} is not in its cluster',
        ),
    ],
    ids=["missing", "not_json", "not_an_object", "no_workers", "no_task", "index", "type"],
)
def test_multi_worker_needs_a_well_formed_tf_config(monkeypatch, tf_config, problem):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(UserInputError) as info:
        distribute.make_strategy("multi_worker")
    assert str(info.value) == f"strategy 'multi_worker': TF_CONFIG {problem}. {_TF_CONFIG_SHAPE}"


def test_tpu_without_an_address_says_so(monkeypatch):
    for variable in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "TPU_CONFIG"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(UserInputError) as info:
        distribute.make_strategy("tpu")
    assert str(info.value) == (
        "strategy 'tpu': no TPU found without an address "
        f"(ValueError: Please provide a TPU Name to connect to.). {_TPU_ALLOWED}"
    )


def test_tpu_address_nobody_listens_on_fails_fast():
    address = f"grpc://127.0.0.1:{_free_port()}"
    with pytest.raises(UserInputError) as info:
        distribute.make_strategy("tpu", tpu=address)
    # Refused, not timed out: the probe does not wait for TensorFlow's retries.
    assert str(info.value) == (
        f"strategy 'tpu': no TPU found at '{address}' (cannot connect to {address}: "
        f"[Errno 111] Connection refused). {_TPU_ALLOWED}"
    )


def test_tpu_resolution_is_bounded(monkeypatch):
    class HangingResolver:
        """Like a TPU name lookup whose metadata server never answers."""

        def __init__(self, tpu):
            time.sleep(30)

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", HangingResolver)
    monkeypatch.setattr(tpu_connection, "TPU_RESOLVE_TIMEOUT_SECONDS", 0.5)
    # Unbounded, the lookup would return after 30 s and no error be raised.
    with pytest.raises(UserInputError) as info:
        distribute.make_strategy("auto", tpu="my-tpu")
    assert str(info.value) == (
        f"strategy 'tpu': no TPU found at 'my-tpu' (no answer within 0.5 s). {_TPU_ALLOWED}"
    )


# --- One machine, fresh runtime (child process) ----------------------------


@pytest.fixture(scope="module")
def local() -> dict[str, Any]:
    # _local_results splits the CPU itself, first thing.
    return run_child(
        "test_backend_tensorflow_distribute", "_local_results", virtual_cpus=0, timeout=300
    )


def test_mirrored_splits_the_cpu_when_asked_first(local):
    assert local["mirrored"] == {
        "replicas": 2,
        "devices": [
            "/job:localhost/replica:0/task:0/device:CPU:0",
            "/job:localhost/replica:0/task:0/device:CPU:1",
        ],
    }
    # Asking again for the same split is fine; another one is too late.
    assert local["mirrored_again"] == 2
    assert local["mirrored_3"] == (
        "virtual_cpus=3: TensorFlow's runtime is already initialized with 2 CPU device(s), so "
        "the CPU can no longer be split; create the strategy before any other TensorFlow op. "
        "Allowed now: virtual_cpus=2"
    )


def test_other_local_strategies(local):
    # No GPU here: one_device and mirrored use the CPU.
    assert local["one_device"] == {
        "class": "OneDeviceStrategy",
        "replicas": 1,
        "devices": ["/job:localhost/replica:0/task:0/device:CPU:0"],
    }
    # Without virtual_cpus: the CPU devices there are, split earlier in this process.
    assert local["mirrored_without_virtual_cpus"] == 2
    assert local["mirrored_reused"] is True
    assert local["mirrored_reused_without_virtual_cpus"] is True
    assert local["auto"] == {"class": "_DefaultDistributionStrategy", "replicas": 1}


def test_local_tpu_without_a_tpu_fails_fast(local):
    assert local["tpu_local"]["message"] == (
        f"strategy 'tpu': no TPU found at 'local' (TPUs not found in the cluster.). {_TPU_ALLOWED}"
    )


# --- Two workers over loopback (child processes) ---------------------------


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> dict[str, Any]:
    model_dir = tmp_path_factory.mktemp("model_dir")
    processes = start_workers([sys.executable, "-c", _WORKER, str(model_dir)])
    results = []
    for returncode, stdout, stderr in communicate_all(processes, timeout=300):
        assert returncode == 0, stderr[-4000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return {"workers": results, "model_dir": str(model_dir)}


def test_each_worker_sees_its_half_of_every_global_batch(workers):
    first, second = (w["seen"] for w in workers["workers"])
    expected = _global_batches(STEPS)
    for step in range(STEPS):
        assert len(first[step]) == len(second[step]) == GLOBAL_BATCH // 2
        # DATA sharding after rebatching: worker i takes the i-th half.
        assert first[step] + second[step] == expected[step]


def test_two_workers_train_like_one_device_on_the_global_batches(workers):
    reference = _train(tf.distribute.get_strategy())
    # The NaN batch is bad data: skipped, left out of the loss and the
    # accuracy (an epoch of only it reports 0), no back-off of the scale.
    assert reference["history"]["loss"][1] == reference["history"]["accuracy"][1] == 0.0
    assert (reference["loss_scale"], reference["skipped_steps"], reference["bad_batches"]) == (
        4.0,
        1,
        1,
    )
    for worker in workers["workers"]:
        assert worker["replicas"] == 2
        # The NaN only worker 1 saw skipped the step on both.
        assert (worker["loss_scale"], worker["skipped_steps"], worker["bad_batches"]) == (4.0, 1, 1)
        assert set(worker["history"]) == set(reference["history"])
        for key, values in reference["history"].items():
            np.testing.assert_allclose(worker["history"][key], values, rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(worker["weights"], reference["weights"], rtol=1e-5, atol=1e-7)


def test_only_the_chief_writes_into_model_dir(workers):
    chief, other = workers["workers"]
    assert (chief["is_chief"], other["is_chief"]) == (True, False)
    assert chief["write_dir"] == workers["model_dir"]
    assert other["write_dir"] != workers["model_dir"]
    assert chief["saved"] and other["saved"]
    assert not other["write_dir_exists_after"]
    assert sorted(os.listdir(workers["model_dir"])) == ["model.keras"]


# --- Child processes ---------------------------------------------------------


def _arrays(nan: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Examples whose feature 0 encodes their index (i / 100).

    With `nan`, the example at position 1 of worker 1's half of global batch 2
    has a NaN feature.
    """
    rng = np.random.default_rng(0)
    features = rng.normal(size=(40, 4)).astype("float32")
    features[:, 0] = np.arange(40) / 100
    labels = (features[:, 1] > 0).astype("int32")
    if nan:
        features[_global_batches(2)[1][GLOBAL_BATCH // 2 + 1], 1] = np.nan
    return features, labels


def _ids(features: np.ndarray) -> list[int]:
    return [int(round(value * 100)) for value in features[:, 0]]


def _stream(nan: bool = False) -> tf.data.Dataset:
    return data.train_batches(*_arrays(nan), GLOBAL_BATCH, seed=0)


def _global_batches(steps: int) -> list[list[int]]:
    return [_ids(features.numpy()) for features, _ in _stream().take(steps)]


def _train(strategy: tf.distribute.Strategy) -> dict[str, Any]:
    """Trains a small MLP with XLA per replica on STEPS steps of the stream.

    Global batch 2 holds a NaN (on worker 1 under two workers); each step is
    validated.
    """
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = models.build_mlp((4,), 2, hidden_units=(8,), dropout=0.0)
        optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=4.0)
        xla.compile_model(
            model,
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=True,
        )
    history = model.fit(
        _stream(nan=True),
        epochs=STEPS,
        steps_per_epoch=1,
        validation_data=data.eval_batches(*_arrays(), GLOBAL_BATCH),
        verbose=0,
    )
    return {
        "model": model,
        "history": history.history,
        "weights": np.concatenate([v.numpy().ravel() for v in model.trainable_variables]).tolist(),
        "loss_scale": optimizer.loss_scale,
        "skipped_steps": optimizer.skipped_steps,
        "bad_batches": optimizer.bad_batches,
    }


def _local_results() -> dict[str, Any]:
    """Strategies of a fresh process: the first TF call splits the CPU."""
    results: dict[str, Any] = {}
    mirrored = distribute.make_strategy("mirrored", virtual_cpus=2)
    results["mirrored"] = {
        "replicas": mirrored.num_replicas_in_sync,
        "devices": list(mirrored.extended.worker_devices),
    }
    results["mirrored_again"] = distribute.make_strategy(
        "mirrored", virtual_cpus=2
    ).num_replicas_in_sync
    try:
        distribute.make_strategy("mirrored", virtual_cpus=3)
    except UserInputError as error:
        results["mirrored_3"] = str(error)
    one_device = distribute.make_strategy("one_device")
    results["one_device"] = {
        "class": type(one_device).__name__,
        "replicas": one_device.num_replicas_in_sync,
        "devices": list(one_device.extended.worker_devices),
    }
    results["mirrored_without_virtual_cpus"] = distribute.make_strategy(
        "mirrored"
    ).num_replicas_in_sync
    # One strategy per device set: its collective keys number on across runs.
    results["mirrored_reused"] = distribute.make_strategy("mirrored") is distribute.make_strategy(
        "mirrored"
    )
    # However asked for: the CPU split by virtual_cpus=2 runs the same one without it.
    results["mirrored_reused_without_virtual_cpus"] = distribute.make_strategy(
        "mirrored"
    ) is distribute.make_strategy("mirrored", virtual_cpus=2)
    auto = distribute.make_strategy("auto")
    results["auto"] = {"class": type(auto).__name__, "replicas": auto.num_replicas_in_sync}
    # Last: a failed TPU connection leaves the runtime connected to nothing.
    try:
        distribute.make_strategy("tpu", tpu="local")
    except UserInputError as error:
        results["tpu_local"] = {"message": str(error)}
    return results


def _worker_results(model_dir: str) -> dict[str, Any]:
    """One worker of a two-worker cluster (TF_CONFIG set by the test)."""
    strategy = distribute.make_strategy("multi_worker")
    seen = []
    iterator = iter(strategy.experimental_distribute_dataset(_stream()))
    for _ in range(STEPS):
        features, _ = next(iterator)
        seen.append(
            [
                i
                for local in strategy.experimental_local_results(features)
                for i in _ids(local.numpy())
            ]
        )
    run = _train(strategy)
    with worker_write_dir(model_dir, strategy) as write_dir:
        path = os.path.join(write_dir, "model.keras")
        run["model"].save(path)
        saved = os.path.exists(path)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "is_chief": is_chief(strategy),
        "seen": seen,
        "history": run["history"],
        "weights": run["weights"],
        "loss_scale": run["loss_scale"],
        "skipped_steps": run["skipped_steps"],
        "bad_batches": run["bad_batches"],
        "write_dir": write_dir,
        "saved": saved,
        "write_dir_exists_after": os.path.exists(write_dir),
    }
