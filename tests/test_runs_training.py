"""Tests of mpt_keras.runs.training.run_training: outputs, resume, refusals."""

import glob
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tiny_runs import Crash, CrashAtStep, manifest_file, overflowing_config, tiny_config

from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.layer_paths import iter_layers
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.runs import precision_plan
from mpt_keras.runs.assembly import plan_precision
from mpt_keras.runs.training import Runtime, run_training


def _weights(model_dir):
    return [
        np.asarray(w)
        for w in keras.saving.load_model(os.path.join(model_dir, "model.keras")).weights
    ]


def _scalars(event_dir):
    values = {}
    for path in sorted(glob.glob(os.path.join(event_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                values.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
    return values


def test_run_writes_every_output(tfds_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    config = tiny_config(tfds_dir, saved_model=True)
    metrics = run_training(config, Runtime(model_dir, verbose=0))

    assert TrainConfig.from_json(os.path.join(model_dir, "config.json")) == config
    with open(os.path.join(model_dir, "metrics.json")) as file:
        assert json.load(file) == metrics
    assert metrics["step"] == 6
    assert metrics["precision"] == "float32"
    assert set(metrics) == {
        "step",
        "precision",
        "loss_scale",
        "skipped_steps",
        "bad_batches",
        "val_loss",
        "val_accuracy",
    }
    assert (metrics["loss_scale"], metrics["skipped_steps"]) == (1.0, 0)
    with open(os.path.join(model_dir, "precision_report.json")) as file:
        report = json.load(file)
    assert [layer["path"] for layer in report["layers"]] == [
        "flatten",
        "dense_0",
        "dropout_0",
        "logits",
    ]
    assert {layer["compute_dtype"] for layer in report["layers"]} == {"float32"}
    assert (report["precision"], report["manifest"]) == ("float32", None)
    assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == [
        "checkpoint",
        "step-3.data-00000-of-00001",
        "step-3.index",
        "step-6.data-00000-of-00001",
        "step-6.index",
    ]

    train = _scalars(os.path.join(model_dir, "logs", "train"))
    assert [step for step, _ in train["loss"]] == [2, 4, 6]
    assert train["loss_scale"] == [(2, 1.0), (4, 1.0), (6, 1.0)]
    assert train["skipped_steps"] == [(2, 0.0), (4, 0.0), (6, 0.0)]
    assert [step for step, _ in train["accuracy"]] == [2, 4, 6]
    # Warm-up to 0.01 over 2 steps, then cosine decay to 0 at step 6; Keras
    # reads the rate for the next update.
    np.testing.assert_allclose(
        [value for _, value in train["learning_rate"]], [0.01, 0.005, 0.0], atol=1e-7
    )
    validation = _scalars(os.path.join(model_dir, "logs", "validation"))
    assert [step for step, _ in validation["loss"]] == [3, 6]
    assert validation["loss"][-1][1] == pytest.approx(metrics["val_loss"], rel=1e-5)
    # The SavedModel serves the trained model's outputs.
    x = np.random.default_rng(0).uniform(0, 255, (4, 8, 8, 1)).astype("float32")
    served = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    trained = keras.saving.load_model(os.path.join(model_dir, "model.keras"))
    np.testing.assert_allclose(served.serve(x), trained.predict(x, verbose=0), rtol=1e-6)


def test_without_a_saved_model_a_run_writes_none_and_a_rerun_may_ask_for_it(tfds_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    run_training(tiny_config(tfds_dir, saved_model=False), Runtime(model_dir, verbose=0))
    assert "saved_model" not in os.listdir(model_dir)
    # A finished run only evaluates, then saves again: now with its SavedModel.
    run_training(tiny_config(tfds_dir, saved_model=True), Runtime(model_dir, verbose=0))
    assert os.path.isfile(os.path.join(model_dir, "saved_model", "saved_model.pb"))


def test_resume_after_a_crash_reaches_the_same_weights_as_an_uninterrupted_run(tfds_dir, tmp_path):
    # Dropout and a warm-up + cosine schedule make the weights depend on the
    # exact step, data position, dropout seeds and optimizer state.
    config = tiny_config(
        tfds_dir, steps=9, model={"options": {"hidden_units": [16], "dropout": 0.3}}
    )
    straight = str(tmp_path / "straight")
    run_training(config, Runtime(straight, verbose=0))

    resumed = str(tmp_path / "resumed")
    with pytest.raises(Crash):
        run_training(config, Runtime(resumed, verbose=0, callbacks=(CrashAtStep(5),)))
    assert not os.path.exists(os.path.join(resumed, "metrics.json"))
    keras.backend.clear_session(free_memory=False)
    metrics = run_training(config, Runtime(resumed, verbose=0))
    assert metrics["step"] == 9

    for a, b in zip(_weights(straight), _weights(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_from_a_step_off_the_checkpoint_grid(tfds_dir, tmp_path):
    # A run that ended at step 4 is extended with checkpoint_every=3: it
    # continues at 4 and checkpoints at 7, then at its end.
    model_dir = str(tmp_path / "run")
    run_training(tiny_config(tfds_dir, steps=4), Runtime(model_dir, verbose=0))
    metrics = run_training(tiny_config(tfds_dir, steps=8), Runtime(model_dir, verbose=0))
    assert metrics["step"] == 8
    steps = sorted(
        int(name.split("-")[1].split(".")[0])
        for name in os.listdir(os.path.join(model_dir, "checkpoints"))
        if name.endswith(".index")
    )
    assert steps == [4, 7, 8]


def test_finished_run_only_evaluates(tfds_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    first = run_training(tiny_config(tfds_dir), Runtime(model_dir, verbose=0))
    keras.backend.clear_session(free_memory=False)
    again = run_training(tiny_config(tfds_dir), Runtime(model_dir, verbose=0))
    assert again == pytest.approx(first)


def test_model_dir_of_another_run_is_refused(tfds_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    run_training(tiny_config(tfds_dir, steps=3), Runtime(model_dir, verbose=0))
    other = tiny_config(tfds_dir, seed=5)
    with pytest.raises(UserInputError) as raised:
        run_training(other, Runtime(model_dir, verbose=0))
    assert str(raised.value) == (
        f"model_dir {model_dir} holds a run whose 'seed' differs (0 there, 5 now): use a new "
        "model_dir, or change only checkpoint_every, deterministic, eval_every, jit_compile, "
        "keep_checkpoints, log_every, saved_model, steps, strategy, tpu, virtual_cpus to resume"
    )


@pytest.mark.parametrize(
    "precision, compute_dtype", [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")]
)
def test_mixed_precision_keeps_float32_master_weights_and_safe_layers(
    tfds_dir, tmp_path, precision, compute_dtype
):
    model_dir = str(tmp_path / "run")
    config = tiny_config(tfds_dir, precision=precision, steps=3)
    metrics = run_training(config, Runtime(model_dir, verbose=0))
    assert metrics["step"] == 3
    with open(os.path.join(model_dir, "precision_report.json")) as file:
        report = json.load(file)
    assert {layer["path"]: layer["compute_dtype"] for layer in report["layers"]} == {
        "flatten": compute_dtype,
        "dense_0": compute_dtype,
        "dropout_0": compute_dtype,
        "logits": "float32",  # Feeds the loss: a safe default.
    }
    assert report["layers"][-1]["decided_by"] == "safe default: model output"
    assert report["trainable_variables"] == {"float32": 4}
    assert all(np.isfinite(w).all() for w in _weights(model_dir))
    loaded = keras.saving.load_model(os.path.join(model_dir, "model.keras"))
    assert [layer.compute_dtype for _, layer in iter_layers(loaded)] == [
        compute_dtype,
        compute_dtype,
        compute_dtype,
        "float32",
    ]


def test_manifest_decides_each_layer_and_float16_layers_get_dynamic_scaling(tfds_dir, tmp_path):
    manifest = manifest_file(
        tmp_path / "manifest.json",
        "mixed_bfloat16",
        {"match": {"path": "dense_0"}, "policy": "mixed_float16"},
    )
    model_dir = str(tmp_path / "run")
    config = tiny_config(tfds_dir, manifest=manifest, steps=2, checkpoint_every=2, eval_every=2)
    metrics = run_training(config, Runtime(model_dir, verbose=0))
    with open(os.path.join(model_dir, "precision_report.json")) as file:
        report = json.load(file)
    assert report["manifest"] == str(manifest)
    assert report["precision"] == metrics["precision"] == "mixed_bfloat16"
    assert [
        (layer["path"], layer["compute_dtype"], layer["decided_by"]) for layer in report["layers"]
    ] == [
        ("flatten", "bfloat16", "default"),
        ("dense_0", "float16", "rules[0] (path 'dense_0')"),
        ("dropout_0", "bfloat16", "default"),
        ("logits", "float32", "safe default: model output"),
    ]
    # One float16 layer is enough for dynamic loss scaling (32768 initially).
    assert metrics["loss_scale"] == 2.0**15


def test_auto_precision_is_resolved_and_explained(tfds_dir, monkeypatch):
    monkeypatch.setattr(
        precision_plan,
        "resolve_auto_policy",
        lambda: ("mixed_float16", "GPU compute capability 7.0: float16 tensor cores"),
    )
    report = plan_precision(tiny_config(tfds_dir, precision="auto"))
    assert report.precision == "mixed_float16"
    assert report.precision_reason == "GPU compute capability 7.0: float16 tensor cores"
    assert report.layers[1].compute_dtype == "float16"


def test_precision_table_lists_each_layer_and_its_decision(tfds_dir):
    table = plan_precision(tiny_config(tfds_dir, precision="mixed_bfloat16")).format_table()
    assert table == (
        "path       class    policy          decided_by\n"
        "flatten    Flatten  mixed_bfloat16  default\n"
        "dense_0    Dense    mixed_bfloat16  default\n"
        "dropout_0  Dropout  mixed_bfloat16  default\n"
        "logits     Dense    float32         safe default: model output\n"
    )


def _tiny_language_model(tfds_dir, **values) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "steps": 2,
            "checkpoint_every": 2,
            "eval_every": 2,
            "data": {
                "name": "mpt_python_source",
                "data_dir": tfds_dir,
                "batch_size": 8,
                "sequence_length": 16,
                "eval_examples": 32,
            },
            "model": {
                "name": "transformer_lm",
                "options": {"num_layers": 1, "d_model": 16, "num_heads": 2},
            },
            **values,
        }
    )


def test_language_model_reports_perplexity(tfds_dir, tmp_path):
    metrics = run_training(_tiny_language_model(tfds_dir), Runtime(str(tmp_path / "lm"), verbose=0))
    assert metrics["val_perplexity"] == pytest.approx(np.exp(metrics["val_loss"]))
    assert metrics["val_bits_per_byte"] == pytest.approx(metrics["val_loss"] / np.log(2))
    # Two steps from a uniform start: the loss is still near log(256).
    assert 4.5 < metrics["val_loss"] < 5.7


def test_float16_overflows_are_skipped_counted_and_back_the_scale_off(tfds_dir, tmp_path):
    # At a scale of 2**24 the float16 gradients overflow: each such step is
    # skipped and halves the scale, and still counts as a step of the run.
    model_dir = str(tmp_path / "run")
    config = tiny_config(
        tfds_dir,
        precision="mixed_float16",
        steps=15,
        loss_scale={"initial_scale": 2.0**24, "max_scale": 2.0**24},
    )
    metrics = run_training(config, Runtime(model_dir, verbose=0))
    assert metrics["step"] == 15
    skipped = metrics["skipped_steps"]
    assert 1 <= skipped < 15
    assert metrics["loss_scale"] == 2.0 ** (24 - skipped)
    assert all(np.isfinite(w).all() for w in _weights(model_dir))
    loaded = keras.saving.load_model(os.path.join(model_dir, "model.keras"))
    assert (loaded.optimizer.loss_scale, loaded.optimizer.skipped_steps) == (
        metrics["loss_scale"],
        skipped,
    )


def test_loss_scale_errors_name_the_config_section_when_the_config_is_read(tfds_dir, tmp_path):
    with pytest.raises(UserInputError) as raised:
        tiny_config(tfds_dir, precision="mixed_float16", loss_scale={"growth_factor": 0.5})
    assert str(raised.value).endswith(
        "key 'loss_scale.growth_factor': received 0.5. Allowed: a number > 1 and <= 3.40282e+38"
    )


def test_auto_promote_moves_layers_that_keep_overflowing_out_of_float16(tfds_dir, tmp_path):
    # Under XLA (execution/xla.py), whose step the promotion makes again.
    model_dir = str(tmp_path / "run")
    config = overflowing_config(
        tfds_dir, tmp_path, checkpoint_every=6, eval_every=6, jit_compile="true"
    )
    metrics = run_training(config, Runtime(model_dir, verbose=0))
    assert (metrics["step"], metrics["skipped_steps"]) == (12, 4)
    assert all(np.isfinite(w).all() for w in _weights(model_dir))
    promoted = PrecisionManifest.from_json(os.path.join(model_dir, "promoted_manifest.json"))
    # The promotion goes first: the first matching rule wins.
    assert [(rule.path, rule.policy) for rule in promoted.rules] == [
        ("dense_0", "mixed_bfloat16"),
        ("dense_0", "mixed_float16"),
    ]


@pytest.mark.parametrize(
    "bad, fix, message",
    [
        (
            {"model": {"options": {"hidden_units": [16], "width": 3}}},
            {"model": {"name": "mlp", "options": {"hidden_units": [16]}}},
            "unknown option 'model.options.width' for model 'mlp'. Allowed: hidden_units, dropout",
        ),
    ],
)
def test_a_bad_config_leaves_model_dir_untouched_and_the_fixed_rerun_trains(
    tfds_dir, tmp_path, bad, fix, message
):
    model_dir = tmp_path / "run"
    config = tiny_config(tfds_dir, precision="mixed_float16", steps=3)
    with pytest.raises(UserInputError) as raised:
        run_training(config.merged(bad), Runtime(str(model_dir), verbose=0))
    assert str(raised.value) == message
    assert not model_dir.exists()
    metrics = run_training(config.merged(bad).merged(fix), Runtime(str(model_dir), verbose=0))
    assert metrics["step"] == 3


def test_a_diverged_language_model_reports_an_infinite_perplexity_in_valid_json(tfds_dir, tmp_path):
    """exp() of a loss past 709.78 overflows: the perplexity is inf, written as "inf"."""
    config = _tiny_language_model(
        tfds_dir, optimizer={"name": "adamw", "learning_rate": 0.001, "weight_decay": 1e12}
    )
    model_dir = str(tmp_path / "lm")
    metrics = run_training(config, Runtime(model_dir, verbose=0))
    assert metrics["val_loss"] > 709.79
    assert metrics["val_perplexity"] == np.inf
    with open(os.path.join(model_dir, "metrics.json")) as file:
        text = file.read()
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert written["val_perplexity"] == "inf"
    assert float(written["val_perplexity"]) == metrics["val_perplexity"]


def test_the_progress_bar_counts_the_steps_each_interval_runs(tfds_dir, tmp_path, capsys):
    """Steps 5 in intervals of 3, then resumed to 10: bars of 3, 2; then 3, 2."""
    model_dir = str(tmp_path / "run")
    run_training(tiny_config(tfds_dir, steps=5), Runtime(model_dir, verbose=2))
    run_training(tiny_config(tfds_dir, steps=10), Runtime(model_dir, verbose=2))
    bars = [line.split(" - ")[0] for line in capsys.readouterr().out.splitlines() if " - " in line]
    assert bars == ["3/3", "2/2", "3/3", "2/2"]
