"""`run_training`, the canary and `mpt-train` on Keras' JAX backend, TensorFlow blocked.

The child runs with two CPU devices (XLA's host platform device count), so `data_parallel`
has two replicas. Each run is the digits MLP of `tiny_runs.tiny_config` for 6 steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading

import jax
import keras
import numpy as np
import pytest
from launchers import launch_console_script, launch_in_process
from tiny_runs import Crash, CrashAtStep, manifest_file, overflowing_config, tiny_config

import mpt_keras
from mpt_keras.errors import UserInputError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _weights(model_dir) -> list[np.ndarray]:
    return keras.saving.load_model(os.path.join(model_dir, "model.keras")).get_weights()


def _run(config, model_dir, **runtime):
    return mpt_keras.run_training(config, mpt_keras.Runtime(str(model_dir), verbose=0, **runtime))


class _HookThreads(keras.callbacks.Callback):
    """The threads `fit` ran batch hooks on (`async_safe`: Keras' choice is the others')."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.threads: set[int] = set()

    def on_train_batch_end(self, batch, logs=None):
        self.threads.add(threading.get_ident())


def test_a_run_writes_its_files_checkpoints_as_numpy_and_no_saved_model(tmp_path):
    hooks = _HookThreads()
    metrics = _run(tiny_config(None), tmp_path, callbacks=(hooks,))
    assert (metrics["step"], metrics["precision"], metrics["skipped_steps"]) == (6, "float32", 0)
    # The run's own callbacks let Keras run batch hooks behind the steps, no wait per step.
    assert threading.get_ident() not in hooks.threads
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoints",
        "config.json",
        "logs",
        "metrics.csv",
        "metrics.json",
        "model.keras",
        "precision_report.json",
        "serving.keras",
    ]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-3.npz", "step-6.npz"]
    report = json.loads((tmp_path / "precision_report.json").read_text())
    assert (report["jit_compile"], report["jit_compile_reason"]) == (
        True,
        "jit_compile=auto: on Keras' jax backend XLA compiles every step",
    )
    assert "tensorflow" not in sys.modules


def test_nan_batches_are_reported_diagnosed_and_stop_the_run_past_the_limit(
    tmp_path, monkeypatch, caplog
):
    # As tests/test_reliability.py on TensorFlow, with the hooks behind the steps: the
    # bad-batch count is read on `fit`'s thread every `log_every` (2) steps, the diagnosis
    # runs there on its step's batch.
    from mpt_keras import data

    original = data.load_run_data

    def poisoned(source, seed, *args):
        loaded = original(source, seed, *args)
        x, y = loaded.train
        order = dataclasses.replace(loaded, train=(np.arange(len(y), dtype="float32")[:, None], y))
        x = x.copy()
        for step in (2, 4):  # A NaN in one example of each.
            x[int(order.batch_of_step(16, seed, step)[0][0, 0])].flat[0] = np.nan
        return dataclasses.replace(loaded, train=(x, y))

    monkeypatch.setattr(data, "load_run_data", poisoned)
    hooks = _HookThreads()
    config = tiny_config(None, precision="mixed_float16", data={"max_bad_batches": 1})
    with caplog.at_level(logging.WARNING), pytest.raises(mpt_keras.RunStoppedError) as stopped:
        _run(config, tmp_path, callbacks=(hooks,))
    assert str(stopped.value).startswith(
        "2 train batches held NaN or Inf values (the latest at step 4), more than "
        "data.max_bad_batches=1"
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w for w in warnings if "Skipped" in w] == [
        "Skipped 1 batch(es) with NaN or Inf inputs, labels or weights at step(s) 2 (1 in the "
        "run).",
        "Skipped 1 batch(es) with NaN or Inf inputs, labels or weights at step(s) 4 (2 in the "
        "run).",
    ]
    [diagnosis] = [w for w in warnings if "first non-finite" in w]
    assert diagnosis.startswith("step 2: first non-finite output: ")
    assert diagnosis.endswith(", its inputs already non-finite")
    assert threading.get_ident() not in hooks.threads
    assert not os.path.exists(tmp_path / "model.keras")


def test_a_crashed_data_parallel_float16_run_resumes_to_the_uninterrupted_weights(tmp_path):
    # Its hidden layer in float8: the scales and amax histories resume exactly too.
    manifest = manifest_file(
        tmp_path / "manifest.json",
        "mixed_float16",
        {"match": {"path": "dense_0"}, "policy": "float8"},
    )
    config = tiny_config(
        None,
        precision="mixed_float16",
        manifest=manifest,
        strategy="data_parallel",
        deterministic=True,
    )
    whole = _run(config, tmp_path / "whole")
    with pytest.raises(Crash):
        _run(config, tmp_path / "crashed", callbacks=(CrashAtStep(5),))
    keras.backend.clear_session(free_memory=False)
    resumed = _run(config, tmp_path / "crashed")
    assert resumed == whole and whole["loss_scale"] == 2.0**15
    crashed = keras.saving.load_model(tmp_path / "crashed" / "model.keras")
    assert sorted(v.path for v in crashed.weights if v.path.startswith("dense_0/")) == [
        "dense_0/bias",
        "dense_0/inputs_amax_history",
        "dense_0/inputs_scale",
        "dense_0/kernel",
        "dense_0/kernel_amax_history",
        "dense_0/kernel_scale",
        "dense_0/outputs_grad_amax_history",
        "dense_0/outputs_grad_scale",
    ]
    for ours, theirs in zip(crashed.get_weights(), _weights(tmp_path / "whole"), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"strategy": "mirrored"},
            "strategy: received 'mirrored', TensorFlow's tf.distribute strategy, not served on "
            "Keras backend jax. Allowed on jax: auto, one_device, data_parallel",
        ),
        (
            {"strategy": "one_device", "virtual_cpus": 2},
            "virtual_cpus=2 needs strategy 'data_parallel' on Keras backend jax; received "
            "strategy 'one_device'. Allowed: virtual_cpus=0, or strategy 'data_parallel'",
        ),
        (
            {"strategy": "data_parallel", "data": {"eval_examples": 65}},
            "the last evaluation batch: received 65, which data_parallel cannot split over its "
            "2 devices. Allowed: a multiple of 2 (data.eval_examples sets the evaluation "
            "examples)",
        ),
        (
            {
                "strategy": "data_parallel",
                "data": {
                    "name": None,  # x a dict of arrays: counted by its examples.
                    "factory": "examples.user_data:python_bytes",
                    "options": {"sequence_length": 8},
                    "eval_examples": 65,
                },
            },
            "the last evaluation batch: received 65, which data_parallel cannot split over its "
            "2 devices. Allowed: a multiple of 2 (data.eval_examples sets the evaluation "
            "examples)",
        ),
        (
            {"strategy": "data_parallel", "data": {"batch_size": 15}},
            "data.batch_size: received 15, which data_parallel cannot split over its 2 devices. "
            "Allowed: a multiple of 2",
        ),
        (
            {"data": {"name": "cifar10"}},
            "data.name 'cifar10': a TFDS dataset. Allowed on Keras' jax backend: data.name "
            "mpt_digits or mpt_python_source (splits train and validation), or a data.factory "
            "returning (x, y[, sample_weight]) arrays; TFDS and tf.data need TensorFlow "
            "(--backend=tensorflow)",
        ),
    ],
)
def test_what_a_jax_run_cannot_do_is_one_line_and_writes_nothing(tmp_path, changes, message):
    with pytest.raises(UserInputError) as raised:
        _run(tiny_config(None, **changes), tmp_path / "run")
    assert str(raised.value) == message
    assert not (tmp_path / "run").exists()


def _transformer(**changes):
    return tiny_config(
        None,
        data={"name": "mpt_python_source", "sequence_length": 8},
        model={
            "name": "transformer_lm",
            "options": {"num_layers": 1, "d_model": 16, "num_heads": 2},
        },
        steps=2,
        checkpoint_every=2,
        eval_every=2,
        **changes,
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU's XLA")
def test_float16_attention_that_a_cpu_cannot_compile_is_one_line_and_writes_nothing(tmp_path):
    config = _transformer(precision="mixed_float16")
    with pytest.raises(UserInputError) as raised:
        _run(config, tmp_path / "run")
    assert str(raised.value) == (
        "float16 layers: the train step does not compile on Keras' JAX backend on this device "
        "(The precision 'F16_F16_F32' is not supported by dot_general on CPU): "
        "jax.nn.dot_product_attention, which Keras' attention layers call, sums float16 in "
        "float32, which JAX lowers on a GPU, not here (attention layers computing float16: "
        "block_0/attention). Allowed here: mixed_bfloat16 or float32, a manifest rule keeping "
        "those layers and their sublayers in float32, or jit_compile false; float16 compiles "
        "on a GPU"
    )
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserInputError, match="block_0/attention"):
        mpt_keras.plan_precision(config)
    # Planned for a GPU (the float8 census's target): nothing to refuse.
    assert mpt_keras.plan_precision(config, census_target="h100").precision == "mixed_float16"
    # What it allows: the attention (and its projections) in float32, the rest float16.
    manifest = manifest_file(
        tmp_path / "manifest.json",
        "mixed_float16",
        {"match": {"path": ".*/attention(/.*)?"}, "policy": "float32"},
    )
    metrics = _run(_transformer(precision="mixed_float16", manifest=manifest), tmp_path / "ok")
    assert metrics["step"] == 2
    # Or not compiled: such a run is not refused, and JAX's eager attention computes float16
    # where the compiled step cannot lower. (An eager run of the whole Transformer compiles each
    # of its ~370 ops for the CPU: half a minute of the suite, for the same two facts.)
    planned = mpt_keras.plan_precision(_transformer(precision="mixed_float16", jit_compile="false"))
    assert planned.jit_compile is False
    _float16_attention_runs_eagerly_not_compiled()
    report = json.loads((tmp_path / "ok" / "precision_report.json").read_text())
    policies = {layer["path"]: layer["compute_dtype"] for layer in report["layers"]}
    assert (policies["block_0/attention/query"], policies["block_0/mlp_up"]) == (
        "float32",
        "float16",
    )


def _float16_attention_runs_eagerly_not_compiled() -> None:
    """What the message says, at the op: Keras' attention computes float16 on this CPU when run
    op by op (forward and gradient), and does not lower when compiled."""
    query = jax.numpy.asarray(np.random.default_rng(0).normal(size=(2, 8, 2, 8)), "float16")

    def loss(query):
        attended = keras.ops.dot_product_attention(query, query, query)
        return keras.ops.sum(keras.ops.cast(attended, "float32"))

    value, gradient = jax.value_and_grad(loss)(query)
    assert (gradient.dtype, bool(np.isfinite(value)), bool(np.isfinite(gradient).all())) == (
        "float16",
        True,
        True,
    )
    with pytest.raises(Exception, match="'F16_F16_F32' is not supported by dot_general on CPU"):
        jax.jit(jax.value_and_grad(loss))(query)


def test_virtual_cpus_split_though_the_config_names_a_metric(tmp_path, monkeypatch):
    """Checking a metric's name makes the metric, and JAX starts as it does: the CPU could no
    longer be split ("JAX is already initialized with 1 CPU device(s)"). The strategy now comes
    first. A process of its own (this one's JAX runs), with one CPU device to split."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    unsplit = [flag for flag in flags if "xla_force_host_platform_device_count" not in flag]
    monkeypatch.setenv("XLA_FLAGS", " ".join(unsplit))
    launched = launch_console_script(
        "mpt-train",
        f"--config={os.path.join(REPO, 'configs', 'digits_mlp.json')}",
        '--config_override={"metrics": ["accuracy"]}',
        "--backend=jax",
        "--strategy=data_parallel",
        "--virtual_cpus=2",
        f"--model_dir={tmp_path / 'run'}",
        "--steps=2",
    )
    assert launched.status == 0, launched.stderr
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["step"] == 2


def test_a_data_factorys_arrays_train_on_jax(tmp_path):
    config = tiny_config(None, data={"name": None, "factory": "examples.user_data:digits_arrays"})
    metrics = _run(config, tmp_path)
    assert metrics["step"] == 6
    report = json.loads((tmp_path / "precision_report.json").read_text())
    assert [layer["path"] for layer in report["layers"]][-1] == "logits"


def test_auto_promote_moves_layers_that_keep_overflowing_out_of_float16_on_jax(tmp_path):
    # As tests/test_runs_training.py on TensorFlow. The step JAX jitted before the promotion
    # kept float16 (a new jit of the same step object ran its old trace).
    hooks = _HookThreads()
    metrics = _run(overflowing_config(None, tmp_path), tmp_path / "run", callbacks=(hooks,))
    assert (metrics["step"], metrics["skipped_steps"]) == (12, 4)
    # AutoPromote reads the model every `check_every` steps in its batch hook: in step.
    assert hooks.threads == {threading.get_ident()}
    promoted = mpt_keras.PrecisionManifest.from_json(tmp_path / "run" / "promoted_manifest.json")
    assert [(rule.path, rule.policy) for rule in promoted.rules] == [
        ("dense_0", "mixed_bfloat16"),
        ("dense_0", "mixed_float16"),
    ]


def test_a_diverging_run_rolls_back_promotes_and_stops_on_jax(tmp_path):
    # As tests/test_reliability.py on TensorFlow: SGD at 30 diverges whatever the precision;
    # the rollback promotes every layer to float32, which does not help. (That the promoted
    # step is traced again: AutoPromote's tests, in tests/any_backend.)
    config = tiny_config(
        None,
        precision="mixed_bfloat16",
        checkpoint_every=2,
        eval_every=2,
        log_every=1,
        optimizer={"name": "sgd", "learning_rate": 30.0},
        divergence={"patience": 2, "max_loss": 5.0, "action": "promote", "max_rollbacks": 1},
    )
    hooks = _HookThreads()
    with pytest.raises(mpt_keras.RunStoppedError, match="after 1 rollbacks"):
        _run(config, tmp_path, callbacks=(hooks,))
    # The divergence guard reads each step's loss: batch hooks run in step (docs/training.md).
    assert hooks.threads == {threading.get_ident()}
    promoted = json.loads((tmp_path / "promoted_manifest.json").read_text())
    assert {rule["policy"] for rule in promoted["rules"]} == {"float32"}


def test_the_canary_runs_before_the_run_on_jax(tmp_path):
    config = tiny_config(None, precision="mixed_bfloat16")
    runtime = mpt_keras.Runtime(str(tmp_path), verbose=0)
    metrics = mpt_keras.train_with_canary(config, runtime, 2)
    assert metrics["step"] == 6
    canary = json.loads((tmp_path / "canary.json").read_text())
    assert (canary["diverged"], canary["steps"], len(canary["baseline_losses"])) == (False, 2, 2)


def test_mpt_train_validate_and_calibrate_run_on_jax_and_refuse_another_backend(tmp_path):
    override = json.dumps(
        {
            "checkpoint_every": 2,
            "eval_every": 2,
            "log_every": 1,
            "model": {"options": {"hidden_units": [16]}},
            "data": {"batch_size": 16, "eval_examples": 64},
        }
    )
    flags = [
        f"--config={os.path.join(REPO, 'configs', 'digits_mlp.json')}",
        f"--config_override={override}",
        "--steps=2",
    ]
    trained = launch_in_process(
        "mpt-train", *flags, "--backend=jax", f"--model_dir={tmp_path / 'run'}"
    )
    assert trained.status == 0, trained.stderr
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["step"] == 2
    refused = launch_in_process(
        "mpt-train", *flags, "--backend=tensorflow", f"--model_dir={tmp_path / 'other'}"
    )
    assert (refused.status, refused.stderr.strip()) == (
        2,
        "mpt-train: error: --backend=tensorflow: Keras is already loaded with backend jax in "
        "this process. Allowed: --backend=jax, or a new process",
    )
    validated = launch_in_process(
        "mpt-validate", *flags, "--precision=mixed_bfloat16", f"--output={tmp_path / 'r.json'}"
    )
    assert validated.status in (0, 1), validated.stderr  # 1: a check failed, in its report.
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["steps"], report["candidate"]) == (2, "mixed_bfloat16")
    assert sorted(os.listdir(tmp_path / "r_logs")) == ["candidate", "float32"]
    calibrated = launch_in_process(
        "mpt-calibrate", *flags, "--steps=1", f"--output={tmp_path / 'm.json'}"
    )
    assert calibrated.status == 0, calibrated.stderr
    stats = json.loads((tmp_path / "m.stats.json").read_text())
    assert (stats["steps"], sorted(stats["layers"])[-1]) == (1, "logits")
    assert "tensorflow" not in sys.modules
