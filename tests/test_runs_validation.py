"""Tests of mpt_keras.runs.validation: parity of a candidate with float32."""

import dataclasses
import json
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tiny_runs import manifest_file

import mpt_keras
from mpt_keras.runs import validation
from mpt_keras.validation.parity_rows import UnreachedLayer
from mpt_keras.validation.report import ValidationReport
from mpt_keras.validation.thresholds import Thresholds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STEPS = 10
# The bundled configs' models, shrunk: tracing, not arithmetic, is what a validation costs.
_SMALL_OPTIONS = {"digits_cnn.json": {"filters": [8, 16], "dense_units": 32}}


def _config(tfds_dir, name, **overrides):
    """Bundled config `name` on `tfds_dir`, its model shrunk, without XLA.

    XLA is not what these tests check (the `auto` rule turns it on for attention and for
    float16 convolutions on CPUs): compiling both models costs more than all their steps.
    tests/test_float8.py and tests/test_execution_xla.py train float8 and mixed precision
    layers under XLA.
    """
    config = mpt_keras.TrainConfig.from_json(os.path.join(REPO, "configs", name))
    small = {"model": {"options": _SMALL_OPTIONS[name]}} if name in _SMALL_OPTIONS else {}
    return config.merged(
        {"jit_compile": "false", "data": {"data_dir": tfds_dir}, **small, **overrides}
    )


def _tiny_lm(tfds_dir, num_layers=1):
    return _config(
        tfds_dir,
        "python_source_transformer.json",
        data={"data_dir": tfds_dir, "batch_size": 4, "sequence_length": 8, "eval_examples": 64},
        model={"options": {"num_layers": num_layers, "d_model": 16, "num_heads": 2}},
        optimizer={"warmup_steps": 0},
    )


@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("config_name", ["digits_mlp.json", "digits_cnn.json"])
def test_mixed_precisions_pass_the_default_thresholds(tfds_dir, config_name, precision):
    report = validation.validate(_config(tfds_dir, config_name), precision, steps=_STEPS)
    assert report.passed, report.table()
    assert [check.name for check in report.checks] == [
        "output_relative_error",
        "top1_agreement",
        "kl_divergence",
        "metric_delta",
        "final_loss_gap",
        "skipped_fraction",
    ]
    assert (len(report.baseline_losses), len(report.candidate_losses)) == (_STEPS, _STEPS)
    assert report.outputs[0].path == "logits"
    assert report.outputs[0].compute_dtype == "float32"  # A safe default.
    compute = precision.removeprefix("mixed_")
    assert {layer.compute_dtype for layer in report.layers[:-1]} == {compute}
    # Low precision does change the outputs; a zero would mean nothing was compared.
    assert 0 < report.outputs[0].relative_error < 0.02


def test_a_tiny_transformer_passes_the_default_thresholds_in_float16(tfds_dir):
    # bfloat16: the bundled float8 manifest's default, below.
    report = validation.validate(_tiny_lm(tfds_dir), "mixed_float16", steps=5)
    assert report.passed, report.table()
    assert [layer.path for layer in report.layers] == [
        "token_embedding",
        "position_embedding",
        "block_0",
        # Its sublayers, after it, in call order.
        "block_0/attention_norm",
        "block_0/attention",
        "block_0/attention/query",
        "block_0/attention/key",
        "block_0/attention/value",
        "block_0/attention/attention_output",
        "block_0/mlp_norm",
        "block_0/mlp_up",
        "block_0/mlp_down",
        "block_0/mlp_dropout",
        "final_norm",
        "logits",
    ]
    # Without dropout, Keras' attention runs a fused kernel beside its softmax and dropout.
    reason = "not called inside 'block_0/attention', which holds it, when the model ran"
    assert report.unreached == (
        UnreachedLayer("block_0/attention/_softmax", reason),
        UnreachedLayer("block_0/attention/_dropout_layer", reason),
    )


@pytest.mark.slow
def test_the_bundled_float8_manifest_passes_the_default_thresholds(tfds_dir):
    """The bundled float8 manifest on the Transformer shrunk to 2 blocks of width 16, its
    12 block matmuls in float8, default steps.

    Forward parity runs on the weights float32 reached: on the initial ones of the bundled
    config top-1 agreement was 0.881, near-uniform logits whose ties e4m3's rounding breaks
    (docs/calibration_and_validation.md).
    """
    manifest = os.path.join(REPO, "configs", "manifests", "python_source_transformer_float8.json")
    report = validation.validate(_tiny_lm(tfds_dir, num_layers=2), manifest)
    assert report.passed, report.table()
    assert report.steps == 50 and report.skipped_steps == 0
    blocks = [layer for layer in report.layers if layer.path in ("block_0", "block_1")]
    assert [layer.compute_dtype for layer in blocks] == ["float32", "float32"]  # The manifest's.
    # Float8 changes the blocks' outputs (0.046, 0.039), 5 to 7 times as much as
    # bfloat16 alone (configs/manifests/python_source_transformer.json: 0.0071, 0.0074).
    assert all(0.01 < layer.relative_error < 0.1 for layer in blocks), report.table()


def test_a_normalization_in_float16_shows_its_drift_at_that_layer(tfds_dir, tmp_path):
    manifest = manifest_file(
        tmp_path / "norm_in_float16.json",
        "float32",
        {"match": {"path": "final_norm"}, "policy": "mixed_float16"},
    )
    report = validation.validate(_tiny_lm(tfds_dir), manifest, steps=2)
    layers = {layer.path: layer for layer in report.layers}
    assert report.drift_entry() == "final_norm"
    assert layers["final_norm"].compute_dtype == "float16"
    for upstream in ("token_embedding", "position_embedding", "block_0"):
        assert layers[upstream].relative_error == 0.0
    assert layers["final_norm"].error_jump == layers["final_norm"].relative_error > 0
    assert "drift enters at final_norm" in report.table()


def _validate_in_bfloat16(build) -> ValidationReport:
    """`validate` of a model of 4 features and 3 classes, 2 steps of 16 random examples."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return validation.validate(
        build,
        "mixed_bfloat16",
        steps=2,
        data=((x, y), (x[:16], y[:16])),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        config=mpt_keras.TrainConfig.from_dict({"data": {"batch_size": 16}}),
    )


def test_a_backbone_inside_ones_own_model_is_compared_layer_by_layer():
    """The probe was a keras.Model on the outer inputs: "features" used 2 times."""

    def build():
        inner = keras.Input((4,), name="features")
        encoder = keras.Sequential([keras.layers.Dense(8, name="project")], name="encoder")
        hidden = keras.layers.Dense(8, activation="relu", name="hidden")(encoder(inner))
        backbone = keras.Model(inner, hidden, name="backbone")
        inputs = keras.Input((4,), name="features")  # Named as the backbone's, as users do.
        return keras.Model(inputs, keras.layers.Dense(3, name="logits")(backbone(inputs)))

    report = _validate_in_bfloat16(build)
    assert [(layer.path, layer.compute_dtype) for layer in report.layers] == [
        ("backbone/encoder/project", "bfloat16"),
        ("backbone/hidden", "bfloat16"),
        ("logits", "float32"),  # The run's safe default for the logits.
    ]
    assert [output.path for output in report.outputs] == ["logits"]
    assert report.unreached == ()
    assert "not compared" not in report.table()
    assert 0 < report.outputs[0].relative_error < 0.05


def test_float32_against_itself_is_exact(tfds_dir):
    report = validation.validate(_config(tfds_dir, "digits_mlp.json"), "float32", steps=3)
    assert all(layer.max_abs_error == 0.0 for layer in report.layers)
    assert report.outputs[0].top1_agreement == 1.0
    assert report.outputs[0].kl_divergence == 0.0
    assert report.baseline_losses == report.candidate_losses
    assert report.baseline_metrics == report.candidate_metrics


def test_an_impossible_threshold_fails_only_its_check(tfds_dir):
    report = validation.validate(
        _config(tfds_dir, "digits_mlp.json"), "mixed_bfloat16", Thresholds(output_rtol=0), steps=3
    )
    assert not report.passed
    assert [check.name for check in report.failed_checks()] == ["output_relative_error"]
    assert "candidate mixed_bfloat16 vs float32: FAIL" in report.table()


def test_run_validation_writes_json_table_png_and_tensorboard(tfds_dir, tmp_path):
    output = tmp_path / "out" / "report.json"
    report = validation.run_validation(
        _config(tfds_dir, "digits_mlp.json"), "mixed_bfloat16", output, steps=3
    )
    values = json.loads(output.read_text())
    assert values["passed"] is True
    assert values["candidate"] == "mixed_bfloat16"
    assert values["candidate_losses"] == list(report.candidate_losses)
    assert values["checks"][0] == {
        "name": "output_relative_error",
        "value": report.checks[0].value,
        "threshold": 0.05,
        "comparison": "<=",
        "passed": True,
    }
    assert (tmp_path / "out" / "report.txt").read_text() == report.table()
    image = tf.io.decode_png((tmp_path / "out" / "report.png").read_bytes())
    assert image.shape == (400, 640, 3)
    curves = sorted(os.listdir(tmp_path / "out" / "report_logs"))
    assert curves == ["candidate", "float32"]


def test_a_bad_candidate_is_a_user_error(tfds_dir):
    with pytest.raises(mpt_keras.UserInputError) as error:
        validation.validate(_config(tfds_dir, "digits_mlp.json"), "float8", steps=1)
    assert str(error.value) == (
        "candidate 'float8': neither a precision nor a manifest file. Allowed: float32, "
        "mixed_float16, mixed_bfloat16, auto, or the path of a manifest (JSON)"
    )


@pytest.mark.parametrize("nan_parity", [False, True], ids=["trained", "a_nan_accuracy"])
def test_a_subclassed_model_of_two_heads_is_gated_on_each_head(nan_parity, monkeypatch):
    """Each returned tensor is an output row, each head float32 (a safe default, found by
    its call), and the accuracy check takes every head's accuracy: a NaN one fails it."""
    train_steps = validation.train_steps

    def with_a_nan_accuracy(config, *args):
        run = train_steps(config, *args)
        if config.precision == "float32":
            return run
        return dataclasses.replace(run, metrics={**run.metrics, "val_parity_accuracy": math.nan})

    if nan_parity:
        monkeypatch.setattr(validation, "train_steps", with_a_nan_accuracy)

    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__(name="two_heads")
            self.hidden = keras.layers.Dense(8, activation="relu", name="hidden")
            self.digit = keras.layers.Dense(3, name="digit")
            self.parity = keras.layers.Dense(1, name="parity")

        def call(self, inputs):
            features = self.hidden(inputs)
            return {"digit": self.digit(features), "parity": self.parity(features)}

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = {"digit": (x[:, 0] > 0).astype("int32"), "parity": (x[:, 1:2] > 0).astype("float32")}
    report = validation.validate(
        TwoHeads,
        "mixed_bfloat16",
        steps=2,
        data=((x, y), (x[:16], {key: value[:16] for key, value in y.items()})),
        loss={
            "digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "parity": keras.losses.BinaryCrossentropy(from_logits=True),
        },
        metrics=["accuracy"],
        config=mpt_keras.TrainConfig.from_dict({"data": {"batch_size": 16}}),
    )
    assert [(layer.path, layer.compute_dtype) for layer in report.outputs] == [
        ("two_heads/digit", "float32"),
        ("two_heads/parity", "float32"),
    ]
    assert report.checks[1].value == min(output.top1_agreement for output in report.outputs)
    drops = [
        report.baseline_metrics[name] - report.candidate_metrics[name]
        for name in ("val_digit_accuracy", "val_parity_accuracy")
    ]
    assert report.checks[3].name == "metric_delta"
    if nan_parity:  # After the digit's drop, which a plain max() would keep.
        assert math.isnan(report.checks[3].value) and not report.checks[3].passed
    else:
        assert report.checks[3].value == max(drops)


def test_a_subclassed_model_is_compared_as_a_block():
    """Its layers, called in its Python call, were unreached: they are rows, after its own."""

    class Mlp(keras.Model):
        def __init__(self):
            super().__init__(name="mlp")
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.logits = keras.layers.Dense(3)
            self.spare = keras.layers.Dropout(0.5)  # Its call never calls it.

        def call(self, inputs):
            return self.logits(self.hidden(inputs))

    report = _validate_in_bfloat16(Mlp)
    assert [(layer.path, layer.compute_dtype) for layer in report.layers] == [
        ("mlp", "bfloat16"),
        ("dense", "bfloat16"),
        ("dense_1", "float32"),  # The run's safe default for the logits.
    ]
    assert report.outputs == report.layers[:1]
    assert 0 < report.outputs[0].relative_error < 0.05
    # The model returned what its last layer did: no drift of its own.
    assert report.layers[0].relative_error == report.layers[2].relative_error
    assert report.layers[0].error_jump == 0.0
    # What it could not reach: said, in the report, the table and the JSON.
    reason = "not called inside 'mlp', which holds it, when the model ran"
    assert report.unreached == (UnreachedLayer("dropout", reason),)
    assert f"not compared (1):\n  dropout: {reason}\n" in report.table()
    assert report.to_dict()["unreached"] == [{"path": "dropout", "reason": reason}]
    # No accuracy metric: no accuracy check.
    assert [check.name for check in report.checks] == [
        "output_relative_error",
        "top1_agreement",
        "kl_divergence",
        "final_loss_gap",
        "skipped_fraction",
    ]


def test_a_config_takes_no_objects_besides():
    with pytest.raises(mpt_keras.UserInputError) as raised:
        validation.validate(mpt_keras.TrainConfig(), "mixed_float16", loss="mse")
    assert str(raised.value) == (
        "a TrainConfig names its own components: received it with data, loss, metrics or "
        "config too. Allowed: a TrainConfig alone, or a model with data and loss"
    )


def test_bad_steps_are_a_user_error():
    with pytest.raises(mpt_keras.UserInputError) as raised:
        validation.validate(mpt_keras.TrainConfig(), "mixed_float16", steps=0)
    assert str(raised.value) == "steps: received 0. Allowed: an integer >= 1"


def test_an_output_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(mpt_keras.UserInputError) as raised:
        validation.run_validation(
            mpt_keras.TrainConfig(), "mixed_float16", tmp_path / "file" / "out" / "report.json"
        )
    assert str(raised.value) == (
        f"--output directory: received {tmp_path / 'file' / 'out'} (cannot be created: Not a "
        "directory). Allowed: a directory that can be created and written"
    )
